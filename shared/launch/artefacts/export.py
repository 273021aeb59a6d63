"""`rlpipe export`: a run's greedy policy as a standalone file (ONNX, TorchScript or torch.export).

``GreedyPolicy`` wraps the agent of the run's latest checkpoint (loaded as `rlpipe evaluate`
loads it) into a module of plain tensors in and out, which the three formats serialise:

- inputs: one tensor per observation leaf, batch first (a Box observation is ``obs``; a Dict
  or Tuple observation gives one input per leaf, named by its key path, e.g. ``position``,
  ``action_mask``); a recurrent agent adds its state ``h`` and ``c`` [B, cores, H] and, where
  its core takes them, ``prev_action`` (the action it chose last) and ``prev_reward`` [B].
  Zero all four where an episode starts. With agent groups (``env.groups``) the ``agent_group``
  leaf is an input too, and a row's state is its group's member's, as in the agent's info.
- outputs: ``action`` (int64 [B] Discrete, [B, k] MultiDiscrete, float32 [B, *shape] Box),
  the family's value head (``value`` V(s) [B] for policy-gradient agents, ``q_values``
  [B, A] for Q agents, ``q`` [B, n_critics] Q_i(s, greedy action) for DDPG/TD3/SAC, quantile
  critics averaged over their quantiles), then ``h_out``, ``c_out`` for a recurrent agent.

An action mask (``model.action_mask``, ``shared.agents.masking``) is an observation input like
any other leaf, and the greedy action is the best legal one, as in rlpipe.

A policy-gradient agent with a centralised value (``env.global_state``, ``shared.agents.pg``)
is exported as its policy alone: no ``global_state`` input and no ``value`` output, since the
value is a training device and a deployed agent acts from its own observation. (Recurrent such
agents are not exported yet: their value core's state travels with the policy's.)

The observation normaliser is part of the graph: the policy takes raw env observations.
Greedy is what evaluation plays with exploration off: the policy's mode (PPO, A2C), argmax Q
(the DQN family, R2D1; ``agent.eps_eval`` is not applied), the actor's mean (DDPG, TD3, SAC).
A ``policy.json`` beside the file names the inputs and outputs with their dtypes and shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from services.evaluator.episodes import Unloadable, load_agent
from shared.agents.config import Memory, RnnState
from shared.agents.masking import legal, masked, masked_argmax
from shared.agents.memory import LstmCore
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from shared.agents.qpg import QpgAgent
from shared.config import loading
from shared.data.namedarraytuple import leaves, map_leaves
from shared.runtime.runfiles import EXPORT_DIR, RUN_CONFIG

FORMATS = {"onnx": "policy.onnx", "torchscript": "policy.ts.pt", "exported": "policy.pt2"}
"""Format -> the file it writes in the output directory."""
METADATA = "policy.json"
EXAMPLE_BATCH = 3
"""Rows of the example inputs the graph is traced with (the batch dimension stays dynamic;
not 1, which torch.export would specialise)."""
ONNX_OPSET = 18


class ExportError(ValueError):
    """What cannot be exported and why, in one line (``rlpipe export`` prints it)."""


def require(module: str, extra: str):
    """``module`` imported, or ExportError naming the pip extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportError(f"the {module.split('.')[0]} package is not installed: pip install 'rlpipe[{extra}]'") from None


@dataclass(frozen=True)
class Signature:
    """The exported graph's interface: input and output names in order."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class ObsTree:
    """The structure of one env observation, to put flat inputs back into. Not kept on the
    module as the namedarraytuple itself: torch.export's scan of a module's attributes indexes
    tuples, and a namedarraytuple's indexing reaches into its leaves."""

    def __init__(self, example) -> None:
        self.example = example
        self.names = [path or "obs" for path, _ in leaves(example)]
        """Input names of the leaves: their key paths, or ``obs`` for a single array."""

    def build(self, flat):
        it = iter(flat)
        return map_leaves(lambda _: next(it), self.example)


def lstm_core(agent: nn.Module) -> LstmCore | None:
    """A recurrent agent's LSTM core (with agent groups its first member's: members are built
    alike), None for a feed-forward agent."""
    members = getattr(agent, "members", None)
    return getattr(agent if members is None else members[0], "core", None)


class GreedyPolicy(nn.Module):
    """The agent's greedy action and value head over plain tensors (see the module docstring).

    ``obs_example``: one env observation (numpy, or a namedarraytuple of leaves), whose
    structure the flat observation inputs are put back into.
    """

    def __init__(self, agent: nn.Module, obs_example) -> None:
        super().__init__()
        if getattr(getattr(agent, "quantile_head", None), "implicit", False):
            raise ExportError("IQN acts on quantile fractions it samples at each step: its greedy action is not "
                              "a function of the observation alone, so it cannot be exported")
        if not isinstance(agent, (PgAgent, QAgent, QpgAgent)):
            raise ExportError(f"{type(agent).__name__}: export knows PgAgent, QAgent and the DDPG/TD3/SAC agents")
        self.agent = agent
        core = lstm_core(agent)
        self.policy_only = bool(getattr(agent, "value_only", ()))
        if self.policy_only:
            if core is not None:
                raise ExportError("a recurrent agent with a centralised value (env.global_state) is not exported yet: "
                                  "its value core's state travels with the policy's")
            obs_example = obs_example._replace(**{key: None for key in agent.value_only})
        self.obs = ObsTree(obs_example)
        obs_names = self.obs.names
        self.recurrent = core is not None
        self.n_obs = len(obs_names)
        extra_in = (["h", "c"] + (["prev_action"] if core.use_action else [])
                    + (["prev_reward"] if core.use_reward else [])) if self.recurrent else []
        head = "value" if isinstance(agent, PgAgent) else "q_values" if isinstance(agent, QAgent) else "q"
        self.signature = Signature(tuple(obs_names + extra_in), ("action",) + (() if self.policy_only else (head,))
                                   + (("h_out", "c_out") if self.recurrent else ()))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        obs = self.obs.build(inputs[:self.n_obs])
        memory = self._memory(inputs[self.n_obs:]) if self.recurrent else None
        agent = self.agent
        if isinstance(agent, PgAgent):
            return self._pg(agent, obs, memory)
        if isinstance(agent, QAgent):
            return self._q(agent, obs, memory)
        unit = agent.mean_action(obs)
        q = agent.q(obs, unit)  # [n_critics, B] (quantile critics: [n_critics, B, quantiles])
        return agent.to_env(unit), (q if q.dim() == 2 else q.mean(-1)).T

    def _memory(self, state: tuple[torch.Tensor, ...]) -> Memory:
        """The recurrent inputs as the agent's acting ``Memory`` (state [B, cores, H])."""
        h, c, rest = state[0], state[1], list(state[2:])
        core = lstm_core(self.agent)
        prev_action = rest.pop(0) if core.use_action else torch.zeros(h.shape[0], dtype=torch.int64)
        prev_reward = rest.pop(0) if core.use_reward else torch.zeros(h.shape[0])
        return Memory(prev_action=prev_action, prev_reward=prev_reward, state=RnnState(h=h, c=c))

    def _pg(self, agent: PgAgent, obs, memory: Memory | None) -> tuple[torch.Tensor, ...]:
        obs = agent.obs_norm(obs) if agent.obs_norm is not None else obs
        if self.policy_only:
            out, value = agent.policy_output(obs), None
        elif memory is None:
            out, value = agent._forward(obs)
        else:
            out, value, h, c = agent.core_step(obs, memory)
        if agent.kind == "box":
            action = out.reshape(-1, *agent.action_shape)
        else:
            out = masked(out, legal(obs, agent.mask_path))
            picks = torch.stack([chunk.argmax(-1) for chunk in torch.split(out, agent.nvec, dim=-1)], dim=-1)
            action = picks[:, 0] if agent.kind == "discrete" else picks
        if self.policy_only:
            return (action,)
        if memory is None:
            return action, value
        return action, value, h, c

    def _q(self, agent: QAgent, obs, memory: Memory | None) -> tuple[torch.Tensor, ...]:
        ok = agent.legal_actions(obs)
        if memory is None:
            q = agent.q_values(obs)
            return masked_argmax(q, ok), q
        obs = agent.obs_norm(obs) if agent.obs_norm is not None else obs
        q, h, c = agent.core_step(obs, memory)
        return masked_argmax(q, ok), q, h, c


def example_inputs(policy: GreedyPolicy, batch: int = EXAMPLE_BATCH) -> tuple[torch.Tensor, ...]:
    """Inputs of ``batch`` rows the graph is traced with: the example observation repeated,
    zero recurrent state."""
    obs = [torch.as_tensor(np.repeat(np.asarray(x)[None], batch, 0)) for _, x in leaves(policy.obs.example)]
    if not policy.recurrent:
        return tuple(obs)
    agent, core = policy.agent, lstm_core(policy.agent)
    cores, size = agent.acting.cores, agent.acting.size
    state = [torch.zeros(batch, cores, size), torch.zeros(batch, cores, size)]
    if core.use_action:
        example = agent.acting.action_example
        state.append(torch.zeros(batch, *example.shape, dtype=example.dtype))
    if core.use_reward:
        state.append(torch.zeros(batch))
    return tuple(obs + state)


def describe(policy: GreedyPolicy, fmt: str, run_dir: Path, state: dict) -> dict:
    """``policy.json``: the format, where the weights come from, and every input and output
    with its dtype and shape (``B`` for the batch dimension)."""
    inputs = example_inputs(policy)
    with torch.no_grad():
        outputs = policy(*inputs)

    def spec(name: str, t: torch.Tensor) -> dict:
        return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": ["B", *t.shape[1:]]}

    exp = loading.load(run_dir / RUN_CONFIG)
    return {"format": fmt, "file": FORMATS[fmt], "algo": exp.algo_name, "env": exp.env.id,
            "run": run_dir.name, "policy_version": int(state["version"]), "env_steps": int(state["env_steps"]),
            "recurrent": policy.recurrent, "obs_normalised_inside": getattr(policy.agent, "obs_norm", None) is not None,
            "inputs": [spec(n, t) for n, t in zip(policy.signature.inputs, inputs)],
            "outputs": [spec(n, t) for n, t in zip(policy.signature.outputs, outputs)]}


def load_policy(run_dir: Path) -> tuple[GreedyPolicy, dict]:
    """The greedy policy of the run's latest checkpoint, and that checkpoint's state.
    ExportError (one line) when the run has no checkpoint."""
    from services.build import env_probe

    exp = loading.load(run_dir / RUN_CONFIG)
    torch.set_num_threads(1)
    try:
        agent, state = load_agent(exp, run_dir)
    except (FileNotFoundError, Unloadable) as e:
        raise ExportError(str(e)) from None
    probe = env_probe(exp)
    obs_example = probe.example_observation()
    probe.close()
    return GreedyPolicy(agent, obs_example), state


def export(run_dir: Path, fmt: str = "onnx", out_dir: Path | None = None) -> Path:
    """Write the greedy policy of ``run_dir``'s latest checkpoint in ``fmt`` (a key of FORMATS)
    and its ``policy.json`` to ``out_dir`` (default: ``run_dir/export``); returns the file.
    ExportError (one line) for an unknown format, a run without a checkpoint, a missing package."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: unknown format; use one of {', '.join(FORMATS)}")
    run_dir = Path(run_dir)
    policy, state = load_policy(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / EXPORT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FORMATS[fmt]
    {"onnx": _onnx, "torchscript": _torchscript, "exported": _exported}[fmt](policy, path)
    (out_dir / METADATA).write_text(json.dumps(describe(policy, fmt, run_dir, state), indent=2) + "\n")
    return path


def _dynamic_shapes(policy: GreedyPolicy, inputs: tuple[torch.Tensor, ...]) -> tuple[dict, ...]:
    batch = torch.export.Dim("batch")
    return (tuple({0: batch} for _ in inputs),)  # forward's one parameter, *inputs


def _program(policy: GreedyPolicy) -> torch.export.ExportedProgram:
    inputs = example_inputs(policy)
    with torch.no_grad():
        return torch.export.export(policy, inputs, dynamic_shapes=_dynamic_shapes(policy, inputs))


def _onnx(policy: GreedyPolicy, path: Path) -> None:
    onnx = require("onnx", "export")
    require("onnxscript", "export")  # torch.onnx's exporter translates the graph with it
    ort = require("onnxruntime", "export")
    program = _program(policy)
    torch.onnx.export(program, (), str(path), input_names=list(policy.signature.inputs),
                      output_names=list(policy.signature.outputs), opset_version=ONNX_OPSET, dynamo=True,
                      external_data=False, verbose=False)
    onnx.checker.check_model(str(path))
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # loads, or says why not


def _torchscript(policy: GreedyPolicy, path: Path) -> None:
    with torch.no_grad():
        traced = torch.jit.trace(policy, example_inputs(policy), check_trace=False)
    traced.save(str(path))


def _exported(policy: GreedyPolicy, path: Path) -> None:
    torch.export.save(_program(policy), str(path))
