"""`rlpipe package`: the folder of a short real run (serial mode) is complete and honest.

The model card's evaluation is `rlpipe evaluate`'s, the weights are the checkpoint's, the
config is the run's as a package shows it, the ONNX policy runs, the curve is a PNG and the video
decodes. `--push` uploads the files it wrote and nothing else (the Hub client's upload is recorded
here); without a Hugging Face token it is one line and leaves the folder. Nothing here reaches the
network.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tomllib
from pathlib import Path

from huggingface_hub import HfApi, constants as hub_constants
import imageio_ffmpeg
import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file

from shared.config import loading
from shared.launch import api
from shared.launch.artefacts import package
from shared.runtime.runfiles import SECRET_FILE
from tests.pipeline import rlpipe_here

CONFIGS = Path(__file__).resolve().parents[1] / "deploy" / "configs"
EPISODES = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A PPO CartPole run of 4096 env steps in serial mode (a few seconds): checkpoint, progress rows, result."""
    cfg = tomllib.loads((CONFIGS / "cartpole_ppo.toml").read_text())
    cfg["run"].update(runs_dir=str(tmp_path_factory.mktemp("runs")), max_env_steps=4096)
    return Path(api.train_serial(cfg, quiet=True)["run_dir"])


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    """No Hugging Face token anywhere huggingface_hub looks (the environment, the token file)."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))


def test_a_package_holds_the_card_weights_config_policy_curve_and_video(trained, tmp_path, no_token):
    out = tmp_path / "pkg"
    made = rlpipe_here("package", str(trained), "--out", str(out), "--episodes", str(EPISODES),
                       "--push", "someone/cartpole-ppo")
    # --push without a token: one line after the folder is written
    assert made.returncode == 2
    assert made.stderr.strip() == ("rlpipe: package: --push: no Hugging Face token; set HF_TOKEN or run "
                                   "`hf auth login` (or publish the folder yourself)")
    assert f"package written to {out}" in made.stdout
    for name in package.FILES:
        assert (out / name).stat().st_size > 0, name

    # The card's evaluation is what `rlpipe evaluate` prints for the same episodes.
    evaluated = rlpipe_here("evaluate", str(trained), "--episodes", str(EPISODES))
    assert evaluated.returncode == 0, evaluated.stderr
    mean, std = map(float, re.search(r"return (\S+) \+- (\S+)", evaluated.stdout).groups())
    card = (out / package.CARD).read_text()
    card_mean, card_std = map(float, re.search(r"\*\*(\S+) \+/- (\S+)\*\*", card).groups())
    assert (round(card_mean, 1), round(card_std, 1)) == (mean, std)
    assert f"value: {card_mean:.2f} +/- {card_std:.2f}" in card  # the Hub's model-index
    checkpoint = torch.load(trained / "checkpoints" / "latest.pt", weights_only=True)
    for needle in ("CartPole-v1", "ppo", f"| env steps | {checkpoint['env_steps']} |", "| lr | `0.002` |",
                   "cores", f"{EPISODES} episodes on held-out env seeds", package.CURVE, package.VIDEO):
        assert needle in card, needle

    weights = load_file(out / package.WEIGHTS)
    assert weights.keys() == checkpoint["agent"].keys()
    assert all(torch.equal(weights[k], checkpoint["agent"][k]) for k in weights)
    shown = loading.load(out / package.CONFIG)
    assert shown == package.public_config(loading.load(trained / "config.toml"))
    assert shown.run.runs_dir == "runs" and str(trained.parent) not in (out / package.CONFIG).read_text() + card

    session = ort.InferenceSession(str(out / "policy.onnx"), providers=["CPUExecutionProvider"])
    action, value = session.run(None, {"obs": np.zeros((2, 4), np.float32)})
    assert action.shape == (2,) and value.shape == (2,)

    assert (out / package.CURVE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    frames = imageio_ffmpeg.read_frames(str(out / package.VIDEO))
    meta = next(frames)
    decoded = sum(1 for _ in frames)
    assert decoded >= 8 and tuple(meta["size"]) == (600, 400)  # CartPole's render size


def test_the_public_config_hides_paths_hosts_accounts_and_string_kwargs():
    exp = loading.from_dict({"run": {"runs_dir": "/home/someone/secret-project/runs"},
                             "env": {"kwargs": '{"map": "/home/someone/maps/a.txt", "frame_skip": 4, "sticky": true, '
                                               '"server": {"url": "https://internal:8443", "retries": [3, "token"]}}'},
                             "network": {"host": "10.1.2.3", "metrics_host": "10.1.2.3", "bind_any": True},
                             "logging": {"entity": "someone"}})
    shown = package.public_config(exp)
    assert shown.run.runs_dir == "runs" and shown.logging.entity == ""
    assert (shown.network.host, shown.network.metrics_host) == ("127.0.0.1", "127.0.0.1")
    assert json.loads(shown.env.kwargs) == {"map": "<private>", "frame_skip": 4, "sticky": True,
                                            "server": {"url": "<private>", "retries": [3, "<private>"]}}
    assert shown.algo == exp.algo and shown.env.id == exp.env.id


def test_push_uploads_the_files_it_wrote_and_nothing_else(trained, tmp_path, monkeypatch):
    """An --out folder holding other things (a copy of the run's secret, logs, a file of its own): one
    commit of the package's files, by name; no byte of the secret, no absolute path of this machine."""
    out = tmp_path / "pkg"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "learner0.log").write_text("a log line\n")
    (out / SECRET_FILE).write_text((trained / SECRET_FILE).read_text())
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id))
        return f"https://huggingface.co/{repo_id}"

    def create_commit(self, repo_id, operations, **kwargs):
        calls.append(("create_commit", repo_id, {op.path_in_repo: Path(op.path_or_fileobj).read_bytes()
                                                 for op in operations}))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    made = rlpipe_here("package", str(trained), "--out", str(out), "--episodes", "1", "--push", "someone/cartpole")
    assert made.returncode == 0, made.stderr
    assert f"uploaded {', '.join(package.FILES)} to https://huggingface.co/someone/cartpole" in made.stdout
    (_, (_, repo, uploaded)) = calls
    assert repo == "someone/cartpole" and list(uploaded) == list(package.FILES)
    secret = (trained / SECRET_FILE).read_bytes()
    for name, data in uploaded.items():
        assert secret not in data and str(trained.parent).encode() not in data, name

    refused = rlpipe_here("package", str(trained), "--out", str(trained))
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        f"rlpipe: package: --out {trained}: that is the run directory, whose config.toml the package's would "
        "replace; give a folder of its own (default: RUN/package)"]


def test_evaluate_and_export_fall_back_to_the_previous_checkpoint(trained, tmp_path):
    """A latest checkpoint cut short (a full disk): evaluate and export (and package, which loads
    through export's function) use previous.pt, as the learner resumes; neither readable is one line."""
    run = tmp_path / trained.name
    shutil.copytree(trained, run)
    latest, previous = run / "checkpoints" / "latest.pt", run / "checkpoints" / "previous.pt"
    shutil.copyfile(latest, previous)
    version = torch.load(previous, weights_only=True)["version"]
    latest.write_bytes(latest.read_bytes()[:100])
    evaluated = rlpipe_here("evaluate", str(run), "--episodes", "2")
    assert evaluated.returncode == 0 and f"policy version {version} " in evaluated.stdout, evaluated.stderr
    exported = rlpipe_here("export", str(run), "--format", "torchscript", "--out", str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "export" / "policy.json").read_text())["policy_version"] == version

    previous.write_bytes(b"")
    evaluated = rlpipe_here("evaluate", str(run), "--episodes", "2")
    assert evaluated.returncode == 1 and len(evaluated.stderr.splitlines()) == 1
    assert evaluated.stderr.startswith("rlpipe: no checkpoint of this run can be loaded (")


def test_package_of_a_run_without_a_checkpoint_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text((CONFIGS / "cartpole_ppo.toml").read_text())
    out = rlpipe_here("package", str(run_dir), "--out", str(tmp_path / "pkg"))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"rlpipe: package: no checkpoint at {run_dir / 'checkpoints/latest.pt'}: "
                                  "the learner writes one every 10 s")


def test_push_without_a_token_touches_nothing(tmp_path, no_token):
    with pytest.raises(package.export.ExportError) as e:
        package.push([], "someone/repo")
    assert "\n" not in str(e.value) and "no Hugging Face token" in str(e.value)


def test_a_missing_package_names_the_hub_extra(trained, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    out = rlpipe_here("package", str(trained), "--out", str(tmp_path / "pkg"))
    assert out.returncode == 2
    assert out.stderr.strip() == "rlpipe: package: the safetensors package is not installed: pip install 'rlpipe[hub]'"
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(package.export.ExportError) as e:
        package.push([], "someone/repo")
    assert str(e.value) == "the huggingface_hub package is not installed: pip install 'rlpipe[hub]'"
