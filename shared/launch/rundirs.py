"""Run directories: make one for a run, find one by name, read its progress and result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
from datetime import datetime
from pathlib import Path
from shared.config import endpoints, loading
from shared.launch import provenance
from shared.transport.auth import write_curve_keys, write_secret
from shared.config.schema import ConfigError, Experiment
from shared.runtime.files import read_csv
from shared.runtime.plugins import IMPORT_DIR
from shared.runtime.process import PRIVATE_UMASK, check_own_dir
from shared.runtime.runfiles import (ACTING_FILE, CHECKPOINTS_DIR, LOGS_DIR, METRICS_DIR, PREVIOUS_RESULT, PROGRESS, RESULT,
                                     RUN_CONFIG)


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def make_run_dir(exp: Experiment, name: str | None = None) -> Path:
    """A fresh run directory ``<runs_dir>/<name>_<stamp>_<random>`` (name: ``run.name`` unless
    given) with the run's config, secret and provenance (``runfiles.META``), and its private socket
    directory. The random
    suffix makes run ids unguessable and keeps two runs started in the same second apart.
    ``runs_dir`` must be ours and writable by no other user (``check_runs_dir``); the run
    directory and what it holds are private (0700 directories, 0600 files)."""
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    base = safe_name(name or exp.run.name)
    root = Path(exp.run.runs_dir)
    old_umask = os.umask(PRIVATE_UMASK)  # this process's, for the files made here (restored below)
    try:
        make_runs_dir(root)
        while True:
            run_dir = root / f"{base}_{stamp}_{secrets.token_hex(3)}"
            try:
                run_dir.mkdir(mode=0o700)
                break
            except FileExistsError:
                continue
        for sub in (LOGS_DIR, METRICS_DIR, CHECKPOINTS_DIR):
            (run_dir / sub).mkdir(mode=0o700)
        make_private_dir(endpoints.socket_base())
        endpoints.socket_dir(run_dir).mkdir(mode=0o700)
        write_secret(run_dir)
        if exp.network.transport == "tcp":
            write_curve_keys(run_dir)
        (run_dir / RUN_CONFIG).write_text(loading.dumps(exp))
        provenance.record(run_dir)
    finally:
        os.umask(old_umask)
    return run_dir.resolve()


def make_runs_dir(root: Path) -> None:
    """Make ``root`` (and its missing parents) a directory of runs only we can write to, whatever
    this process's umask (``umask 002`` would leave a grid's or tune's directory group-writable,
    which ``check_runs_dir`` then refuses), or refuse an existing one as ``check_runs_dir`` does."""
    old_umask = os.umask(PRIVATE_UMASK)
    try:
        root.mkdir(parents=True, exist_ok=True)
    finally:
        os.umask(old_umask)
    check_runs_dir(root)


def check_runs_dir(root: Path) -> None:
    """Refuse a ``run.runs_dir`` that is not our directory, or that another user can write to
    (they could swap a run directory, whose modules the services import)."""
    check_own_dir(root, "set run.runs_dir to a directory of your own that only you can write to "
                  "(or `chmod go-w` it)", shared_ok=True)


def reopen_run_dir(run_dir: Path) -> None:
    """Make a stopped run's directory ready to start again (``launch --resume``): its socket
    directory back, the previous result set aside (the run goes on to a new one), the
    previous learner's acting.json gone."""
    make_private_dir(endpoints.socket_base())
    endpoints.socket_dir(run_dir).mkdir(mode=0o700, exist_ok=True)
    result = run_dir / RESULT
    if result.exists():
        result.replace(run_dir / PREVIOUS_RESULT)
    (run_dir / ACTING_FILE).unlink(missing_ok=True)  # the restarted learner writes it when its agent is built


def safe_name(name: str) -> str:
    """``name`` with each character a run id may not hold (letters, digits, '_' and '.') made '_'."""
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name)


def make_private_dir(path: Path) -> None:
    """Make ``path`` a directory only we can enter (0700), or refuse one another user owns."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_own_dir(path, "another user could reach this run's sockets; remove it, or set XDG_RUNTIME_DIR to a "
                  "private directory")


def programs(exp: Experiment) -> list[tuple[str, int, int, str]]:
    """The run's services: (service, instances, start priority, autorestart: "true", or
    "unexpected" for the learner, whose exit 0 ends the run), under supervisord or Ray."""
    services = [("replay", 1, 10, "true"), ("learner", exp.learner.count, 20, "unexpected"), ("sampler", exp.sampler.count, 40, "true")]
    if exp.sampler.inference == "server":
        services.insert(2, ("action_server", exp.action_server.count, 30, "true"))
    if exp.network.metrics_port:
        services.insert(0, ("metrics", 1, 5, "true"))
    if exp.eval.every_s:
        services.append(("evaluator", 1, 50, "true"))
    return services


def resolve_run(name: str, runs_dir: str = "runs") -> Path:
    """A run directory from a path or a run id under ``runs_dir``."""
    for candidate in (Path(name), Path(runs_dir) / name):
        if (candidate / RUN_CONFIG).exists():
            return candidate.resolve()
    raise FileNotFoundError(f"no run directory {name!r} (give its path, or its id under {runs_dir}/)")


def read_progress(run_dir: Path) -> list[dict]:
    """progress.csv's rows, dicts of strings; whole rows only (``files.read_csv``)."""
    return read_csv(run_dir / PROGRESS)


def read_result(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / RESULT).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


CODE_ROOT = Path(__file__).resolve().parents[2]
"""Where rlpipe's own packages (``shared``, ``services``) are: a checkout, or site-packages."""

_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # "module:attribute" (not a URL, not a path)


def service_env(exp: Experiment) -> dict[str, str]:
    """The import path of a run's services: ``PYTHONPATH`` holds rlpipe's own code (``CODE_ROOT``:
    the services run the launcher's code, from a checkout too), then the user's own ``PYTHONPATH``;
    site-packages comes next, before anything of the launch directory. The launch directory is
    added (``plugins.IMPORT_DIR``, at the end of ``sys.path``) only where a ``module:attribute``
    of the config names a module found there, and only if no other user can write to it
    (``check_own_dir``): launched from /tmp or a group-writable directory, another user's
    ``numpy.py`` there would otherwise run in every service. ConfigError naming the field and
    the fix where the directory fails that check."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys([str(CODE_ROOT), *extra]))}
    here = Path.cwd()
    for field, ref in _references(dataclasses.asdict(exp)):
        top = ref.partition(":")[0].split(".")[0]
        if here == CODE_ROOT or not ((here / f"{top}.py").is_file() or (here / top).is_dir()):
            continue
        try:
            check_own_dir(here, "", shared_ok=True)
        except PermissionError as e:
            raise ConfigError(f"{field} = {ref!r}: module {top!r} would be imported from the launch directory, "
                              f"{str(e).rstrip(': ')}; launch from a directory only you can write to (or `chmod "
                              "go-w` it)") from None
        env[IMPORT_DIR] = str(here)
    return env


def _references(tree, prefix: str = ""):
    """(field, value) of each ``module:attribute`` string in a config's dict."""
    for key, value in tree.items():
        field = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _references(value, field + ".")
        elif isinstance(value, str) and _REFERENCE.match(value):
            yield field, value
