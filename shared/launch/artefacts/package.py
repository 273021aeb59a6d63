"""`rlpipe package`: a run's trained agent as a folder to publish as is (a Hugging Face Hub
model repository, or any file share), and `--push` to upload it.

The folder (``FILES``): a model card ``README.md`` (env, algorithm, hyperparameters, the
training curve, the greedy evaluation `rlpipe evaluate` gives over N episodes on the held-out
seeds, env steps, wall time, hardware), the latest checkpoint's agent weights as
``model.safetensors``, the run's resolved ``config.toml``, the greedy policy as ONNX with its
``policy.json`` (``shared.launch.artefacts.export``), ``training_curve.png`` (``shared.launch.lab.plots``)
and ``replay.mp4``, the first evaluation episode (gymnasium's RecordVideo through moviepy).

What a package shows is public: its config and card hold no absolute path of this machine and no
value an env may take that could be private (``public_config``); ``--push`` uploads the files
``package`` wrote, by name, and nothing else of the folder (no run ``secret``, logs or stale files).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import torch

from services.evaluator.episodes import CannotRender, evaluate, load_agent
from shared.config import loading
from shared.config.topology import topology
from shared.launch.artefacts import export
from shared.launch.lab import plots
from shared.launch.rundirs import read_result
from shared.runtime.runfiles import PACKAGE_DIR, RUN_CONFIG

CARD, WEIGHTS, CONFIG, CURVE, VIDEO = "README.md", "model.safetensors", "config.toml", "training_curve.png", "replay.mp4"
FILES = (CARD, WEIGHTS, CONFIG, export.FORMATS["onnx"], export.METADATA, CURVE, VIDEO)
"""What a package holds (the curve and the video only where the run has progress rows and
the env renders)."""
CARD_SECTIONS = ("algo", "agent", "model", "env", "sampler", "learner", "replay")
"""Config sections the card lists as hyperparameters (all of them are in config.toml)."""
PRIVATE = "<private>"
"""What a package shows for a string value of ``env.kwargs``."""


def public_config(exp):
    """``exp`` as a package shows it: ``run.runs_dir``, the network hosts and the W&B entity back
    to their defaults (an absolute path names the user's machine and account, a host its
    network), and every string in ``env.kwargs`` (a path, a URL, a key an env may take) shown
    as PRIVATE; the numbers and booleans of ``env.kwargs`` stay (they are hyperparameters)."""

    def hide(value):
        if isinstance(value, str):
            return PRIVATE
        if isinstance(value, dict):
            return {k: hide(v) for k, v in value.items()}
        if isinstance(value, list):
            return [hide(v) for v in value]
        return value

    kwargs = json.dumps(hide(json.loads(exp.env.kwargs))) if exp.env.kwargs else ""
    run, net, lg = type(exp.run)(), type(exp.network)(), type(exp.logging)()
    return dataclasses.replace(
        exp, run=dataclasses.replace(exp.run, runs_dir=run.runs_dir),
        env=dataclasses.replace(exp.env, kwargs=kwargs),
        network=dataclasses.replace(exp.network, host=net.host, metrics_host=net.metrics_host),
        logging=dataclasses.replace(exp.logging, entity=lg.entity))


def package(run_dir: Path, out_dir: Path | None = None, episodes: int | None = None) -> list[Path]:
    """Write the package of ``run_dir``'s latest checkpoint to ``out_dir`` (default:
    ``run_dir/package``), evaluated over ``episodes`` greedy episodes (default: the run's
    ``eval.episodes``); returns the files written, in FILES order (the package's files an
    earlier package left there and this one did not write are removed). ExportError (one line)
    for a run without a checkpoint, a missing package (safetensors, onnx, onnxruntime), or the
    run directory itself as ``out_dir`` (its own config.toml would be overwritten)."""
    run_dir = Path(run_dir)
    exp = loading.load(run_dir / RUN_CONFIG)
    episodes = exp.eval.episodes if episodes is None else episodes
    safetensors_torch = export.require("safetensors.torch", "hub")
    out = Path(out_dir) if out_dir is not None else run_dir / PACKAGE_DIR
    if out.resolve() == run_dir.resolve():
        raise export.ExportError(f"--out {out}: that is the run directory, whose config.toml the package's would "
                                 "replace; give a folder of its own (default: RUN/package)")
    out.mkdir(parents=True, exist_ok=True)
    export.export(run_dir, "onnx", out)  # first: the one-line error of a run without a checkpoint
    _, state = load_agent(exp, run_dir)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state["agent"].items()}  # no shared storage
    safetensors_torch.save_file(tensors, str(out / WEIGHTS), metadata={
        "format": "pt", "algo": exp.algo_name, "env": exp.env.id, "policy_version": str(state["version"]),
        "env_steps": str(state["env_steps"])})
    public = public_config(exp)
    (out / CONFIG).write_text(loading.dumps(public))
    result = evaluate(exp, run_dir, episodes)  # the numbers `rlpipe evaluate RUN --episodes N` prints
    try:
        plots.plot_runs([run_dir], out / CURVE)
        curve = True
    except ValueError:  # no finished episode in progress.csv yet
        curve = False
    video = _record(exp, run_dir, out / VIDEO)
    (out / CARD).write_text(model_card(public, run_dir, state, result, curve, video))
    written = [name for name in FILES if (name != CURVE or curve) and (name != VIDEO or video is None)]
    for stale in set(FILES) - set(written):
        (out / stale).unlink(missing_ok=True)
    return [out / name for name in written]


def _record(exp, run_dir: Path, path: Path) -> str | None:
    """Record one greedy episode to ``path``; None, or why there is no video."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            evaluate(exp, run_dir, 1, Path(tmp) / "video")  # a folder RecordVideo makes: it warns of one that exists
        except CannotRender as e:
            return str(e)
        recorded = sorted((Path(tmp) / "video").glob("*.mp4"))
        if not recorded:
            return "the episode recorder wrote no video"
        shutil.move(recorded[0], path)
    return None


def hardware() -> str:
    """This host: CPU, cores, GPU (the run's own host is not recorded in its directory)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {gpu}; "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}")


def model_card(exp, run_dir: Path, state: dict, result: dict, curve: bool, no_video: str | None) -> str:
    """The README.md of a package: Hub metadata (YAML front matter) and the card's sections."""
    run_result = read_result(run_dir) or {}
    wall_s = run_result.get("wall_s", state.get("wall_s"))
    score = f"{result['mean_return']:.2f} +/- {result['std_return']:.2f}"
    algo, env = exp.algo_name, exp.env.id
    seeds = topology(exp).eval_seed
    lines = [
        "---",
        "library_name: rlpipe",
        "tags:",
        *(f"- {t}" for t in ("reinforcement-learning", "deep-reinforcement-learning", env, algo)),
        "model-index:",
        f"- name: {algo} on {env}",
        "  results:",
        "  - task:",
        "      type: reinforcement-learning",
        "      name: reinforcement-learning",
        "    dataset:",
        f"      name: {env}",
        f"      type: {env}",
        "    metrics:",
        "    - type: mean_reward",
        f"      value: {score}",
        "      name: mean_reward",
        "      verified: false",
        "---",
        "",
        f"# {algo.upper()} on {env}",
        "",
        f"A {algo} agent trained with rlpipe on `{env}`: run `{run_dir.name}`, "
        f"policy version {state['version']}.",
        "",
        "| | |",
        "|---|---|",
        f"| environment | `{env}` |",
        f"| algorithm | {algo} |",
        f"| env steps | {int(state['env_steps'])} |",
        f"| wall time | {'not recorded' if wall_s is None else f'{float(wall_s):.1f} s'} |",
        f"| run ended | {run_result.get('reason', 'not recorded (the run has no result.json)')} |",
        f"| hardware (where this package was made) | {hardware()} |",
        "",
        "## Evaluation",
        "",
        f"Greedy policy, {result['episodes']} episodes on held-out env seeds (from {seeds}): "
        f"**{score}** (min {result['min_return']:.2f}, max {result['max_return']:.2f}). "
        f"`rlpipe evaluate {run_dir.name} --episodes {result['episodes']}` gives the same numbers.",
        "",
    ]
    if curve:
        lines += ["## Training curve", "", f"![mean return of the last episodes against env steps]({CURVE})", ""]
    lines += ["## Video", "",
              f"[{VIDEO}]({VIDEO}): the first evaluation episode." if no_video is None else f"No video: {no_video}.", ""]
    lines += ["## Hyperparameters", "", f"The whole resolved config is [{CONFIG}]({CONFIG}).", ""]
    for section in CARD_SECTIONS:
        values = vars(getattr(exp, section))
        lines += [f"`[{section}]`" + (f" (`{algo}`)" if section == "algo" else ""), "", "| key | value |", "|---|---|"]
        lines += [f"| {k} | `{json.dumps(v, default=str)}` |" for k, v in values.items()]
        lines.append("")
    lines += [
        "## Files", "",
        f"- `{WEIGHTS}`: the agent's state_dict (load into the agent rlpipe builds from `{CONFIG}`)",
        f"- `{export.FORMATS['onnx']}`: the greedy policy, observation normaliser inside; inputs and "
        f"outputs in `{export.METADATA}`",
        "",
        "```python",
        "import onnxruntime as ort",
        f"session = ort.InferenceSession(\"{export.FORMATS['onnx']}\")",
        "action, *rest = session.run(None, {\"obs\": observations})  # a batch [B, ...] of raw observations",
        "```",
        "",
    ]
    return "\n".join(lines)


def push(files: list[Path], repo: str) -> str:
    """Upload ``files`` (what ``package`` wrote), each by its name, to the Hub model repo ``repo``
    (made if missing), in one commit; returns the repo's URL. Nothing else of their folder goes.
    ExportError (one line) without huggingface_hub, without a token, or when the Hub refuses."""
    hub = export.require("huggingface_hub", "hub")
    token = hub.get_token()
    if not token:
        raise export.ExportError("--push: no Hugging Face token; set HF_TOKEN or run `hf auth login` "
                                 "(or publish the folder yourself)")
    api = hub.HfApi(token=token)
    try:
        url = api.create_repo(repo, repo_type="model", exist_ok=True)
        api.create_commit(repo_id=repo, repo_type="model", commit_message="rlpipe package",
                          operations=[hub.CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f))
                                      for f in files])
    except Exception as e:  # HTTP errors, bad repo ids, no network: one line, the folder stays
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise export.ExportError(f"--push {repo}: {type(e).__name__}: {first}") from None
    return str(url)
