"""Weights & Biases logging (``[logging] wandb``): a real CartPole PPO run through the pipeline
logs its progress scalars against env steps and its resolved config to an offline W&B run in the
run directory, with the default config under ``WANDB_MODE=offline``; a learner killed and restarted
from an older checkpoint, and ``launch --resume``, continue the same W&B run id without logging a
row twice; a W&B endpoint that never answers does not stop training; asking for W&B without the
package is one config error line. Nothing here touches the network beyond 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import threading
import tomllib
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shared.runtime.runfiles import WANDB_ID, WANDB_STEP
from shared.runtime.runfiles import RUN_CONFIG, TB_DIR
from tests.pipeline import Run, rlpipe_here, wait_for

BLOCK = 32 * 1024
"""A .wandb file is a LevelDB-format log (wandb-core's store): 32 KiB blocks of records, each with
a 7-byte header (crc32c, length, type), after a 7-byte file header (':W&B', magic, version)."""
FULL, FIRST, LAST = 1, 2, 4


def wandb_records(path: Path) -> list:
    """The protobuf ``Record``s of a .wandb file, in order: W&B has no Python reader of its
    own for these any more (``wandb sync`` reads them in wandb-core), so this follows the format."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, parts, records = 7, [], []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if length == 0 and kind == 0:
            break  # zeros: the end of what was written
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
        else:
            assert kind in (FIRST, 3), f"{path}: record type {kind} at {pos}"
    return records


def finished_records(path: Path) -> list:
    """The records of a finished run's .wandb file once its exit record is there: W&B's
    ``finish`` returns before wandb-core has written the last rows (0.31: a run's history was
    empty right after it in about 1 read of 3 here, whole a second later)."""
    def whole():
        records = wandb_records(path)
        return records if records and records[-1].WhichOneof("record_type") == "exit" else None

    return wait_for(whole, 60, f"the exit record of {path}")


def read_offline_run(wandb_dir: Path) -> dict:
    """What one finished offline W&B run holds: its run record, the config and the history rows."""
    (path,) = wandb_dir.glob("run-*.wandb")
    run, config, history = None, {}, []
    for r in finished_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
            config.update({item.key: json.loads(item.value_json) for item in r.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in r.config.update})
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in r.history.item})
    return {"run": run, "config": {k: v for k, v in config.items() if not k.startswith("_")},  # _wandb: W&B's own
            "history": history}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B kept off the network and out of the home directory, in this process and the services
    supervisord starts (they inherit the environment)."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                        "WANDB_DISABLE_CODE": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                        "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():
        monkeypatch.setenv(name, value)


def test_an_offline_wandb_run_holds_the_scalars_and_config_and_a_resumed_run_keeps_its_id(tmp_path, offline_wandb,
                                                                                        monkeypatch):
    """The default logging.mode and project: WANDB_MODE=offline and WANDB_PROJECT decide. The learner
    is killed (-9) after a few rows; restarted with no checkpoint it counts its env steps from 0
    again, and the rows W&B already has are not logged twice."""
    monkeypatch.setenv("WANDB_PROJECT", "rlpipe-test")
    run = Run.launch(tmp_path, "cartpole_ppo.toml", "run.max_env_steps=20480", "logging.wandb=true",
                     "logging.group='seeds'", "logging.tags=['ppo', 'cartpole']", "learner.checkpoint_interval_s=1000")
    try:
        def wandb_step() -> int:
            return int((run.dir / WANDB_STEP).read_text()) if (run.dir / WANDB_STEP).exists() else 0

        run.wait_for(lambda: wandb_step() >= 1024, 60, "W&B to take a row at 1024 env steps")
        os.kill(run.pid("learner0"), signal.SIGKILL)
        had = wandb_step()  # what W&B took from the killed learner (the .wandb file may not hold it all: W&B buffers)
        result = run.wait_result(90)
        assert result["env_steps"] == 20480, result
        killed, first = sorted((run.dir / "wandb").glob("offline-run-*"))
        logged = read_offline_run(first)
        assert [h["env_steps"] for h in logged["history"] if "env_steps" in h][0] > had  # no row twice
        run_id = (run.dir / WANDB_ID).read_text()
        assert logged["run"].run_id == run_id and first.name.endswith(run_id)
        assert killed.name.endswith(run_id)  # the restarted learner continued the same W&B run
        assert logged["run"].project == "rlpipe-test" and logged["run"].run_group == "seeds"
        assert list(logged["run"].tags) == ["ppo", "cartpole"] and logged["run"].display_name == run.id
        assert logged["config"] == tomllib.loads((run.dir / RUN_CONFIG).read_text())  # the resolved config
        assert logged["config"]["logging"]["wandb"] is True and logged["config"]["run"]["max_env_steps"] == 20480

        # Every progress row of the restarted learner past what W&B had, with the scalars TensorBoard got, at the
        # row's env steps.
        every = run.progress()
        restart = next(i for i in range(1, len(every)) if int(every[i]["env_steps"]) < int(every[i - 1]["env_steps"]))
        rows = [r for r in every[restart:] if int(r["env_steps"]) > had]
        history = [h for h in logged["history"] if "env_steps" in h]
        assert [h["env_steps"] for h in history] == [int(r["env_steps"]) for r in rows]
        assert history[-1]["env_steps"] == 20480
        assert history[-1]["progress/mean_return"] == pytest.approx(float(rows[-1]["mean_return"]))
        tensorboard = EventAccumulator(str(run.dir / TB_DIR))
        tensorboard.Reload()
        tags = tensorboard.Tags()["scalars"]
        assert {"algo/policy_loss", "algo/value_loss", "progress/mean_return"} <= set(tags)
        assert set(tags) == {key for h in history for key in h if "/" in key}
        for tag in tags:
            logged_at = {h["env_steps"]: h[tag] for h in history if tag in h}
            # TensorBoard drops the killed learner's events at and past the restarted one's first step.
            assert {e.step: pytest.approx(e.value, rel=1e-6, abs=1e-6) for e in tensorboard.Scalars(tag)
                    if e.step > had} == logged_at

        stopped = rlpipe_here("stop", str(run.dir))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        resumed = rlpipe_here("launch", "--resume", str(run.dir), "--detach")
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert run.wait_result(60)["env_steps"] == 20480  # the checkpoint's count goes on
        # Its one row, at the budget, is one W&B has: no W&B run is started for it.
        assert sorted((run.dir / "wandb").glob("offline-run-*")) == [killed, first]
        assert (run.dir / WANDB_ID).read_text() == run_id
    finally:
        run.close()
    assert run.segments() == []


def test_wandb_asked_for_without_the_package_is_one_config_error_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module that cannot be imported
    common = ("launch", "--detach", "--set", f"run.runs_dir='{tmp_path / 'runs'}'")
    out = rlpipe_here(*common, "--set", "logging.wandb=true")
    assert out.returncode == 2 and not (tmp_path / "runs").exists()
    assert out.stderr.splitlines() == ["rlpipe: config error: logging.wandb = true: the wandb package is not installed; "
                                       "pip install 'rlpipe[wandb]' (or set logging.wandb = false)"]
    out = rlpipe_here(*common, "--set", "logging.wandb=true", "--set", "logging.mode='sometimes'")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["rlpipe: config error: logging.mode = 'sometimes': allowed: online, offline, "
                                       "disabled, or empty (WANDB_MODE decides)"]


@pytest.fixture
def silent_endpoint():
    """A W&B server address on 127.0.0.1 that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


def test_a_wandb_that_never_answers_does_not_stop_training(tmp_path, offline_wandb, monkeypatch, silent_endpoint):
    """Online W&B against a server that accepts and stays silent: the run trains to its budget, its
    result written, while wandb.init waits for its timeout; the learner says W&B was given up on."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", silent_endpoint)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # a key of the right form: W&B goes as far as the server
    run = Run.launch(tmp_path, "cartpole_ppo.toml", "run.max_env_steps=4096", "logging.wandb=true",
                     "logging.timeout_s=3")
    try:
        result = run.wait_result(60)
        assert result["reason"] == "budget" and result["env_steps"] == 4096, result
        assert result["updates"] == 16 and len(run.progress()) >= 2
        assert "learner: no W&B run (" in run.logs("learner0")
        assert not (run.dir / WANDB_STEP).exists()  # W&B took no row
    finally:
        run.close()
    assert run.segments() == []


def test_the_evaluators_video_goes_to_wandb_with_its_evaluation(tmp_path, offline_wandb):
    """``eval.video``: the evaluator's recording of a version (``record_episode``, what it runs after
    each evaluation) reaches the W&B run as eval/video with that evaluation's scalars, read back
    from the offline run's files; a row without a new evaluation logs no video again."""
    from services.evaluator.episodes import record_episode
    from services.learner.wandb_run import EVAL_VIDEO, WandbRun
    from shared.config import loading
    from shared.runtime import evaluation
    from tests.test_evaluator_service import untrained_agent

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    exp = loading.from_dict({"logging": {"wandb": True, "mode": "offline", "project": "rlpipe-test"},
                             "eval": {"video": True}})
    (run_dir / RUN_CONFIG).write_text(loading.dumps(exp))
    video = evaluation.video_path(run_dir, 7)
    ret = record_episode(exp, untrained_agent(exp), video)
    assert ret >= 1 and video.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    evaluation.record(run_dir, {"wall_time": 0.0, "policy_version": 7, "env_steps": 512, "episodes": 4,
                                "mean_return": 21.5, "std_return": 2.0, "min_return": 19.0, "max_return": 24.0,
                                "eval_s": 0.4, "video": str(video.relative_to(run_dir))})
    wandb = WandbRun(exp.logging, run_dir)
    wandb.log({"progress/mean_return": 20.0}, 600)
    wandb.log({"progress/mean_return": 22.0}, 700)
    wandb.close()

    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    history = read_offline_run(offline)["history"]
    (with_video,) = [h for h in history if f"{EVAL_VIDEO}/_type" in h]  # a media value's fields, flattened
    assert with_video["eval/env_steps"] == 512 and with_video["eval/mean_return"] == 21.5
    assert with_video[f"{EVAL_VIDEO}/_type"] == "video-file"
    assert with_video[f"{EVAL_VIDEO}/sha256"] == hashlib.sha256(video.read_bytes()).hexdigest()
    assert (offline / "files" / with_video[f"{EVAL_VIDEO}/path"]).read_bytes() == video.read_bytes()
    assert [h["env_steps"] for h in history if "env_steps" in h] == [600, 700]
