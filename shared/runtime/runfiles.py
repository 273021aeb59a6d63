"""The names of a run directory's files and folders, declared once for every process.

A run directory is what `rlpipe launch` (or `rlpipe train --serial`, a grid, a tune trial)
makes; every service of the run, the launcher and the lab's readers (`rlpipe results`, `ls`,
plots, evaluate, export, package) find its files by these names. They are part of a run's
on-disk format: a name changed here breaks every run made before, so old runs could no
longer be resumed, evaluated or read. Paths are relative to the run directory.

This module imports nothing: the bottom layer, importable by all.
"""

# Made at launch (shared/launch/rundirs.py, provenance.py, shared/transport/auth.py)
RUN_CONFIG = "config.toml"
"""The resolved config every service reads; its presence makes a folder a run directory."""
META = "meta.json"
"""Where the run came from: the code's commit, the host, the command and the date, written
once when the directory is made (shared/launch/provenance.py)."""
SECRET_FILE = "secret"
"""The per-run secret a peer proves it belongs to the run with (0600; shared/transport/auth.py)."""
CURVE_DIR = "curve"
"""The run's CURVE key pairs over TCP (shared/transport/auth.py)."""
CLIENTS_DIR = "clients"
"""Inside CURVE_DIR: the public keys the ZAP handler admits (*.key), and the run's client pair."""
LOGS_DIR = "logs"
"""Every process's log: the services' (supervisord's or Ray's capture), supervisord's own,
the watchdog's, serial mode's and a grid job's follower's."""
SERIAL_LOG = "serial0.log"
"""Inside LOGS_DIR: the log of `rlpipe train --serial` (shared/launch/api.py)."""
FOLLOW_LOG = "follow.log"
"""Inside LOGS_DIR: a grid job's follower's output (shared/launch/lab/grid.py)."""
METRICS_DIR = "metrics"
"""prometheus_client's multiprocess files of every service (PROMETHEUS_MULTIPROC_DIR): what
the metrics endpoint serves and `rlpipe status` reads the time split from."""
CHECKPOINTS_DIR = "checkpoints"
"""The learner's checkpoints (CHECKPOINT, PREVIOUS_CHECKPOINT)."""

# The supervisord backend (shared/launch/supervisor.py)
SUPERVISORD_CONF = "supervisord.conf"
"""The run's generated supervisord config, written by the launcher (and by `rlpipe scale`)."""
SUPERVISORD_PID = "supervisord.pid"
"""The run's supervisord writes its pid there before it starts a service."""
SUPERVISORD_LOG = "supervisord.log"
"""Inside LOGS_DIR: supervisord's own log, which the foreground follower reads."""

# The Ray backend (shared/launch/ray_backend.py)
CLUSTER_FILE = "cluster.json"
"""Written by the Ray backend at launch: the cluster the run's actors live in."""

# The learner (services/learner/)
PROGRESS = "progress.csv"
"""The learner's progress rows, one every `run.log_interval_s` (services/learner/progress.py)."""
POOL_ELO = "pool_elo.csv"
"""With a self-play pool: each pool version's Elo, games and score against the learner, one row a
version at each progress row (services/learner/progress.py)."""
RESULT = "result.json"
"""How the run ended: written by the learner at the end, or by the watchdog when it stops
the run; every follower of the run ends at it."""
PREVIOUS_RESULT = "result.previous.json"
"""A resumed run's former RESULT, moved aside by `rlpipe launch --resume` (shared/launch/rundirs.py)."""
CHECKPOINT = CHECKPOINTS_DIR + "/latest.pt"
"""The learner's latest checkpoint (services/learner/checkpoints.py)."""
PREVIOUS_CHECKPOINT = CHECKPOINTS_DIR + "/previous.pt"
"""The checkpoint before it, what a load falls back to after a crash mid-write."""
ACTING_FILE = "acting.json"
"""What the samplers and action-servers need to act, written by the learner once its
parameters are published (shared/agents/acting.py)."""
TB_DIR = "tb"
"""TensorBoard event files: the learner's (progress scalars and algorithm diagnostics against
env steps); other services (the evaluator) add theirs beside them with their own writers."""
WANDB_ID = "wandb_id"
"""The learner's W&B run id, so that a restarted learner resumes the same W&B run."""
WANDB_STEP = "wandb_step"
"""The env steps of the last progress row W&B took (services/learner/wandb_run.py)."""

# The evaluator (services/evaluator/, `rlpipe evaluate`; shared/runtime/evaluation.py)
EVAL_CSV = "eval.csv"
"""One row an evaluation."""
EVAL_LATEST = "eval.json"
"""The latest evaluation's result."""
VIDEOS = "videos"
"""The evaluator's videos, `eval_v<policy version>.mp4`."""

# Replay (services/replay/)
SNAPSHOT_DIR = "replay"
"""Replay's table snapshots, with `replay.persist`."""

# The artefacts' default folders
EXPORT_DIR = "export"
"""`rlpipe export`'s default output folder (shared/launch/artefacts/export.py)."""
PACKAGE_DIR = "package"
"""`rlpipe package`'s default output folder (shared/launch/artefacts/package.py)."""
