"""`rlpipe launch`, `clean` and `stop` against mistakes and other users: an impossible model
is one config line, a service crash-looping at start stops the run with its log tail,
runs get unguessable ids, a private socket directory and a secret, and processes are found
by their exact run directory, never by a substring of it."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.runtime import runfiles
from shared.transport import auth
from shared.config import endpoints, loading, schema
from shared.launch import rundirs, supervisor
from shared.runtime import plugins
from shared.runtime.runfiles import RUN_CONFIG
from tests.pipeline import CONFIGS, rlpipe

IMAGE_ENV = 'env.id="tests.envs_for_tests:make_image_cartpole"'


def test_a_dict_observation_with_an_8x8_image_learns_with_encoder_auto():
    from services.serial import train_serial

    exp = loading.load(CONFIGS / "cartpole_ppo.toml", [IMAGE_ENV, "run.target_return=200.0", "run.max_env_steps=100000"])
    assert exp.model.encoder == "auto"
    result = train_serial(exp)
    assert result["reason"] == "target" and result["mean_return"] >= 200, result


def test_a_model_that_cannot_be_built_fails_at_launch_in_one_line(tmp_path):
    out = rlpipe("launch", str(CONFIGS / "cartpole_ppo.toml"), "--set", IMAGE_ENV, "--set", 'model.encoder="nature_cnn"',
                 "--set", f"run.runs_dir='{tmp_path}'", "--set", "network.metrics_port=0")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlpipe: config error: the ppo agent (encoder = 'nature_cnn') "
                                                   "cannot be built"), lines
    assert "8x8 image is smaller than the Nature CNN's 36x36 minimum" in lines[0]
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing started


def test_a_continuous_control_algorithm_on_discrete_actions_fails_at_launch_in_one_line(tmp_path):
    out = rlpipe("launch", str(CONFIGS / "pendulum_sac.toml"), "--set", 'env.id="CartPole-v1"',
                 "--set", f"run.runs_dir='{tmp_path}'", "--set", "network.metrics_port=0")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "the sac agent" in lines[0] and "need a Box" in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_a_service_crashing_at_start_makes_launch_exit_with_its_log_tail(tmp_path):
    t0 = time.monotonic()
    out = rlpipe("launch", str(CONFIGS / "cartpole_ppo.toml"), "--set",
                 'env.id="tests.envs_for_tests:make_env_failing_under_supervisord"',
                 "--set", f"run.runs_dir='{tmp_path}'", "--set", "network.metrics_port=0", timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stdout + out.stderr
    assert "exited with an error within 20 s of starting (2 such exits in this run): run stopped" in out.stderr
    assert "RuntimeError: simulated start-up crash of a service" in out.stderr  # the service's own log tail
    assert took < 30, f"launch took {took:.1f} s to give up"
    [run_dir] = tmp_path.iterdir()
    assert supervisor.service_pids(run_dir) == [] and not list(Path("/dev/shm").glob(f"rlpipe-{run_dir.name}-*"))


@pytest.fixture
def private_base(tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    return xdg / "rlpipe"


def test_runs_get_random_ids_private_socket_dirs_and_a_secret_only_we_can_read(tmp_path, private_base):
    exp = loading.load(CONFIGS / "cartpole_ppo.toml", [f"run.runs_dir='{tmp_path / 'runs'}'"])
    a, b = rundirs.make_run_dir(exp), rundirs.make_run_dir(exp)
    assert a != b and a.name.startswith("cartpole_ppo_") and len(a.name.rsplit("_", 1)[1]) == 6
    for run_dir in (a, b):
        sockets = endpoints.socket_dir(run_dir)
        assert sockets.parent == private_base and stat.S_IMODE(os.stat(sockets).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(private_base).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(run_dir / runfiles.SECRET_FILE).st_mode) == 0o600
    assert len(auth.read_secret(a)) == 64 and auth.read_secret(a) != auth.read_secret(b)
    os.chmod(a / runfiles.SECRET_FILE, 0o644)
    with pytest.raises(PermissionError, match="with mode 0600"):
        auth.read_secret(a)


def test_a_socket_base_that_is_not_our_private_directory_is_refused(tmp_path, private_base):
    exp = loading.load(CONFIGS / "cartpole_ppo.toml", [f"run.runs_dir='{tmp_path / 'runs'}'"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    private_base.symlink_to(elsewhere)  # planted by someone who wants our sockets where they can reach them
    with pytest.raises(PermissionError, match="is not a directory of uid"):
        rundirs.make_run_dir(exp)
    private_base.unlink()
    if os.getuid() == 0:  # only root can make a directory another user's
        private_base.mkdir(mode=0o777)
        os.chown(private_base, 12345, 12345)
        with pytest.raises(PermissionError, match="owner uid 12345"):
            rundirs.make_run_dir(exp)


def test_processes_are_found_by_their_exact_run_directory(tmp_path):
    runs = tmp_path / "runs"
    (runs / "x_2").mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--run-dir", "runs/x_2"],
                               cwd=tmp_path)  # argv as a service has it, relative to its cwd
    try:
        deadline = time.monotonic() + 10
        while sleeper.pid not in supervisor.service_pids(runs / "x_2"):
            assert time.monotonic() < deadline, "the process naming runs/x_2 was not found"
            time.sleep(0.05)
        assert sleeper.pid not in supervisor.service_pids(runs / "x")
        assert sleeper.pid not in supervisor.service_pids(runs / "x_")
        (runs / "x").mkdir()
        (runs / "x" / "supervisord.pid").write_text(str(sleeper.pid))  # stale: that pid is not x's supervisord
        assert supervisor.supervisord_pid(runs / "x") is None
        supervisor.clean(runs / "x")
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stop_terminates_a_starting_service_that_lost_supervisords_signal(tmp_path):
    """supervisord's SIGTERM to a child it forked a moment before can go nowhere (see
    supervisor._terminate_unguarded): a run's process still without a SIGTERM handler gets one
    from stop itself; one that handles SIGTERM (a running service, mid clean exit) is left be."""
    (tmp_path / "runs" / "r").mkdir(parents=True)
    argv = ["--run-dir", "runs/r"]
    starting = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)", *argv],
                                cwd=tmp_path, stdout=subprocess.PIPE)
    running = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                "lambda *a: None); print(flush=True); time.sleep(60)", *argv],
                               cwd=tmp_path, stdout=subprocess.PIPE)
    try:
        starting.stdout.readline(), running.stdout.readline()
        supervisor._terminate_unguarded(tmp_path / "runs" / "r")
        assert starting.wait(timeout=10) == -signal.SIGTERM
        time.sleep(0.2)
        assert running.poll() is None
    finally:
        for proc in (starting, running):
            proc.kill()
            proc.wait()


def test_clean_of_a_run_leaves_a_live_run_whose_name_extends_it_running(runs, tmp_path):
    live = runs("cartpole_ppo.toml", "run.target_return=1e9")
    live.wait_steps(1_000)
    before = live.status()
    prefix = live.dir.parent / live.dir.name[:-2]  # run X beside the live run X_2..., as the issue saw it
    prefix.mkdir()
    shutil.copy(live.dir / RUN_CONFIG, prefix / RUN_CONFIG)
    (prefix / "supervisord.pid").write_text((live.dir / "supervisord.pid").read_text())  # a stale pidfile, too
    out = rlpipe("clean", str(prefix))
    assert out.returncode == 0 and "killed 0 process(es)" in out.stdout, out.stdout + out.stderr
    assert live.status() == before and all(state == "RUNNING" for state, _ in before.values()), before
    steps = int(live.progress()[-1]["env_steps"])
    live.wait_steps(steps + 1_000, timeout=60)


def test_every_service_runs_one_blas_thread(tmp_path):
    """A numpy acting step of a 256x256 MLP took ~7 ms with OpenBLAS's two threads against
    ~0.1 ms with one: a torch-free local sampler ran DQN's acting at 47% of a core until
    start_service limited BLAS for every service (not only those that set up torch)."""
    shutil.copy(CONFIGS / "cartpole_dqn.toml", tmp_path / RUN_CONFIG)
    script = ("import sys; from threadpoolctl import threadpool_info; from services.process import start_service; "
              "start_service('sampler', ['--run-dir', sys.argv[1], '--instance', '0']); "
              "print(sorted({p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas'}))")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["[1]"], out.stdout + out.stderr


def test_runs_dir_must_be_ours_and_run_directories_are_private(tmp_path, private_base):
    """Another user who can write to runs_dir could swap a run directory (whose modules the
    services import); and nothing a run writes is readable by other users."""
    runs = tmp_path / "runs"
    exp = loading.load(CONFIGS / "cartpole_ppo.toml", [f"run.runs_dir='{runs}'", "network.transport='tcp'"])
    run_dir = rundirs.make_run_dir(exp)
    assert os.umask(0o022) == 0o022  # make_run_dir gave this process its umask back
    for path in [run_dir, *run_dir.rglob("*")]:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0, f"{path}: {oct(mode)}"
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    os.chmod(runs, 0o777)
    with pytest.raises(PermissionError, match="can be written by other users"):
        rundirs.make_run_dir(exp)
    os.chmod(runs, 0o755)
    if os.getuid() == 0:  # only root can make a directory another user's
        os.chown(runs, 12345, 12345)
        with pytest.raises(PermissionError, match="owner uid 12345"):
            rundirs.make_run_dir(exp)


def _service_env_in(monkeypatch, where: Path, *overrides: str) -> dict:
    """The services' import path of a run launched from ``where`` (the launcher, as `python -m
    shared.launch.cli` there, imports the config's modules from it)."""
    monkeypatch.chdir(where)
    monkeypatch.syspath_prepend(str(where))
    return rundirs.service_env(loading.load(CONFIGS / "cartpole_ppo.toml", list(overrides)))


def test_services_import_site_packages_before_the_launch_directory_and_only_its_named_modules(tmp_path,
                                                                                            monkeypatch):
    """Launched from a directory holding the config's env module and a stray numpy.py: the
    services import the env module from there and numpy from site-packages; a config that names
    nothing there does not put it on their path."""
    (tmp_path / "mylab_envs.py").write_text("import gymnasium\nimport numpy\nLOADED_FROM = __file__\n"
                                            "def make():\n    return gymnasium.make('CartPole-v1')\n")
    (tmp_path / "numpy.py").write_text("raise SystemExit('the launch directory shadowed numpy')\n")
    os.chmod(tmp_path, 0o755)
    assert plugins.IMPORT_DIR not in _service_env_in(monkeypatch, tmp_path)  # CartPole-v1: nothing from there
    env = _service_env_in(monkeypatch, tmp_path, "env.id='mylab_envs:make'")
    assert env[plugins.IMPORT_DIR] == str(tmp_path) and str(tmp_path) not in env["PYTHONPATH"].split(os.pathsep)
    check = ("from shared.runtime.plugins import load_attribute; import numpy; load_attribute('mylab_envs:make', "
             "'env.id'); import mylab_envs; print(numpy.__file__, mylab_envs.LOADED_FROM)")
    out = subprocess.run([sys.executable, "-c", check], cwd="/", env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    numpy_file, module_file = out.stdout.split()
    assert "site-packages" in numpy_file and module_file == str(tmp_path / "mylab_envs.py")


def test_a_launch_directory_other_users_can_write_to_is_refused_where_the_config_imports_from_it(tmp_path,
                                                                                                   monkeypatch):
    (tmp_path / "mylab_envs.py").write_text("def make():\n    pass\n")
    os.chmod(tmp_path, 0o775)
    with pytest.raises(schema.ConfigError, match=r"^env.id = 'mylab_envs:make': module 'mylab_envs' would be "
                       r"imported from the launch directory, .* can be written by other users"):
        _service_env_in(monkeypatch, tmp_path, "env.id='mylab_envs:make'")
    assert plugins.IMPORT_DIR not in _service_env_in(monkeypatch, tmp_path)  # nothing imported from there: no objection
