"""Benchmark: time per gradient step of the learner against a plain eager-torch loop.

Both sides run in this process, one thread, alternating, on the same batch shapes:

- plain: CleanRL-style code with nothing around it: two ``nn.Sequential`` MLPs (or one Q
  net and its target), the loss written inline, Adam, gradient clipping;
- rlpipe: ``Learner.train`` on a numpy batch slot like the one replay fills (torchify,
  GAE with recomputed values for PPO, the algorithm's update, counters), the shipped
  CartPole configs' networks and hyperparameters, divided by its gradient steps.

Medians of 7 alternating rounds; the ratio rlpipe / plain is what the issue bounds (<= 1.2).
The other cases time variants of rlpipe's learner against each other the same way.
Run with `make bench`.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.learner.learner import Learner
from shared.agents import groups
from shared.config import loading as config
from services.build import batch_spec, env_probe, example_step, make_agent, make_algo
from shared.data.namedarraytuple import from_spec, leaves
from tests.pipeline import CONFIGS

pytestmark = pytest.mark.bench
ROUNDS = 7


def mlp(sizes, act=nn.Tanh) -> nn.Sequential:
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def plain_ppo(n: int, hidden: tuple):
    actor, critic = mlp([4, *hidden, 2]), mlp([4, *hidden, 1])
    params = [*actor.parameters(), *critic.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3, eps=1e-5)
    obs, action = torch.randn(n, 4), torch.randint(0, 2, (n,))
    old_logp, adv, ret = torch.full((n,), -0.69), torch.randn(n), torch.randn(n)

    def step():
        logp_all = torch.log_softmax(actor(obs), -1)
        logp = logp_all.gather(-1, action[:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        ratio = (logp - old_logp).exp()
        pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        v_loss = 0.5 * ((critic(obs).squeeze(-1) - ret) ** 2).mean()
        loss = pg - 0.0 * entropy + 0.5 * v_loss
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()

    return step


def plain_dqn(n: int, hidden: tuple):
    q = mlp([4, *hidden, 2], nn.ReLU)
    target = mlp([4, *hidden, 2], nn.ReLU).requires_grad_(False)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    obs, nxt, action = torch.randn(n, 4), torch.randn(n, 4), torch.randint(0, 2, (n,))
    ret, disc = torch.randn(n), torch.full((n,), 0.95)
    rows = torch.arange(n)

    def step():
        with torch.no_grad():
            a_star = q(nxt).argmax(-1)
            y = ret + disc * target(nxt)[rows, a_star]
        loss = F.huber_loss(q(obs)[rows, action], y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(q.parameters(), 10.0)
        opt.step()

    return step


def rlpipe_learner(config_file: str, device: torch.device = torch.device("cpu"), overrides: tuple[str, ...] = (),
                   prepare=lambda agent: None):
    """(train one batch and return the update's stats, gradient steps per batch, batch size, hidden
    sizes) for a shipped config with ``overrides``, its learner on ``device``; ``prepare(agent)``
    runs once the algorithm is built."""
    exp = config.load(CONFIGS / config_file, ["run.max_env_steps=1000000000", f"run.device='{device}'", *overrides])
    probe = env_probe(exp)
    agent = make_agent(exp, probe).to(device)
    learner = Learner(exp, agent, make_algo(exp, agent), device, run_dir=None)
    prepare(agent)
    probe.close()
    slot = from_spec(batch_spec(exp, example_step(exp, probe)))
    rng = np.random.default_rng(0)
    for _, leaf in leaves(slot):
        if leaf.dtype == np.bool_:
            leaf[...] = rng.random(leaf.shape) < 0.02
        elif leaf.dtype.kind in "iu":
            leaf[...] = rng.integers(0, 2, leaf.shape)
        else:
            leaf[...] = rng.normal(size=leaf.shape) * 0.1
    if "samples" in slot:
        slot.samples.agent_info.log_prob[...] = -0.69
        steps, n = exp.algo.epochs * exp.algo.minibatches, slot.samples.reward.size
    else:
        slot.is_weight[...] = 1.0
        slot.bootstrap_discount[...] = 0.95
        steps, n = 1, len(slot.action)
    meta = {"env_steps": 0, "episodes": []}
    return (lambda: (learner.train(slot, meta), learner.last_stats)[1]), steps, n, exp.model.hidden_sizes


def per_step_ms(fn, steps_per_call: int, calls: int) -> float:
    fn()  # warm-up (allocator, lazy state)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / (calls * steps_per_call) * 1e3


@pytest.mark.parametrize("config_file, plain", [("cartpole_ppo.toml", plain_ppo), ("cartpole_dqn.toml", plain_dqn)])
def test_learner_step_vs_plain_eager_torch(config_file, plain):
    torch.set_num_threads(1)
    train, steps, n, hidden = rlpipe_learner(config_file)
    base = plain(n, hidden)
    ours, theirs = [], []
    calls = max(1, 200 // steps)
    for _ in range(ROUNDS):
        theirs.append(per_step_ms(base, 1, calls * steps))
        ours.append(per_step_ms(train, steps, calls))
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"\n{config_file}: batch {n}, {steps} gradient step(s) per batch: rlpipe learner "
          f"{statistics.median(ours):.2f} ms/step (runs {[round(x, 2) for x in ours]}), plain eager torch "
          f"{statistics.median(theirs):.2f} ms/step (runs {[round(x, 2) for x in theirs]}); ratio {ratio:.2f}")
    assert ratio > 0


@pytest.mark.parametrize("config_file, overrides, calls", [
    ("pendulum_sac.toml", ("model.hidden_sizes=[256, 256]", "algo.batch_size=256"), 30),
    ("minatar_breakout_dqn.toml", (), 30),
    ("connect_four_board_ppo.toml", (), 3),  # a call: a PPO update of 2,048 rows, 16 gradient steps
], ids=["sac_256x256_batch256", "minatar_dqn_cnn", "connect_four_board_ppo"])
def test_bf16_autocast_and_threads_vs_the_same_runs_fp32(config_file, overrides, calls):
    """The learner options of issue 38's MuJoCo and MinAtar rows and of issue 39's learner-bound
    Connect Four run: ``learner.autocast = "bf16"`` and ``learner.threads = 2`` against one-thread
    fp32, alternating rounds in one process (ratios < 1: faster). bf16 pays where the CPU has bf16
    instructions (avx512_bf16, AMX)."""
    variants = {"fp32": ("off", 1), "bf16": ("bf16", 1), "fp32, 2 threads": ("off", 2), "bf16, 2 threads": ("bf16", 2)}
    trains = {name: rlpipe_learner(config_file, overrides=(*overrides, f"learner.autocast='{autocast}'"))[0]
              for name, (autocast, _) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, (_, threads) in variants.items():
            torch.set_num_threads(threads)
            times[name].append(per_step_ms(trains[name], 1, calls))
    torch.set_num_threads(1)
    base = statistics.median(times["fp32"])
    print(f"\n{config_file} {' '.join(overrides)}: fp32 one thread {base:.2f} ms a learner call; " + "; ".join(
        f"{name} {statistics.median(t):.2f} ms ({statistics.median(t) / base:.2f}x)" for name, t in times.items()
        if name != "fp32"))
    assert base > 0


SPREAD = ("env.id='pettingzoo:mpe2.simple_spread_v3'", "env.kwargs='{\"N\": 3, \"max_cycles\": 25}'")


def test_agent_groups_vs_one_shared_policy():
    """Issue 39: the learner's PPO gradient step with two agent groups (agent_0; agent_1 and agent_2,
    each group its own 64x64 policy and value) against one shared policy, on simple_spread with
    simple_adversary_groups_ppo.toml's learner (16 worlds x 3 agents x 25 steps: 600-row minibatches,
    10 epochs x 2 minibatches, values recomputed for GAE), one thread. The groups' rows split by
    member (eager mode on the CPU), and routed by ``torch.where`` with every member on every row
    (``groups.split_min_rows(math.inf)``: what an export computes, and the learner did before the split)."""
    torch.set_num_threads(1)
    shared, steps, n, _ = rlpipe_learner("simple_adversary_groups_ppo.toml", overrides=(*SPREAD, "env.groups={}"))
    grouped, _, _, _ = rlpipe_learner("simple_adversary_groups_ppo.toml",
                                      overrides=(*SPREAD, "env.groups={ a = 'agent_0', b = 'agent_[12]' }"))
    times: dict[str, list[float]] = {"one policy": [], "groups, split": [], "groups, every row": []}
    calls = max(1, 200 // steps)
    for _ in range(ROUNDS):
        times["one policy"].append(per_step_ms(shared, steps, calls))
        times["groups, split"].append(per_step_ms(grouped, steps, calls))
        with groups.split_min_rows(math.inf):
            times["groups, every row"].append(per_step_ms(grouped, steps, calls))
    base = statistics.median(times["one policy"])
    print(f"\nsimple_spread PPO, batch {n}, {steps} gradient steps per batch: one policy {base:.2f} ms/step "
          f"(runs {[round(x, 2) for x in times['one policy']]}); " + "; ".join(
              f"{name} {statistics.median(t):.2f} ms ({statistics.median(t) / base:.2f}x; runs "
              f"{[round(x, 2) for x in t]})" for name, t in times.items() if name != "one policy"))
    assert base > 0


@pytest.mark.parametrize("hidden", [64, 256])
def test_agent_groups_split_against_every_member_on_every_row_by_rows(hidden):
    """Where the split of rows by group starts to pay (``groups.SPLIT_MIN_ROWS``): PPO's
    ``evaluate`` + backward and its acting ``step`` on 16-128 simple_spread rows, two groups of
    ``hidden`` x ``hidden`` networks, the rows split (the threshold set to 0) against every member
    on every row; ratios < 1: the split is faster."""
    from shared.agents.config import ModelConfig
    from shared.agents.pg import PgAgent
    from shared.data.namedarraytuple import map_leaves, torchify
    from shared.envs.backends import make_env_group
    from shared.envs.group import EnvConfig
    from tests.test_envs import Buffers

    torch.set_num_threads(1)
    env = make_env_group(EnvConfig(id="pettingzoo:mpe2.simple_spread_v3", kwargs='{"N": 3, "max_cycles": 25}',
                                   groups={"a": "agent_0", "b": "agent_[12]"}), 3, 0)
    buf = Buffers(env)
    env.reset(buf.obs)
    env.close()
    agent = PgAgent(env.example_observation(), env.action_space, ModelConfig(hidden_sizes=(hidden, hidden)),
                    obs_space=env.observation_space)
    lines = []
    for n in (16, 32, 48, 64, 96, 128):
        obs = torchify(map_leaves(lambda x: np.resize(x, (n, *x.shape[1:])), buf.obs))
        action = torch.zeros(n, dtype=torch.int64)

        def train():
            sum(agent.evaluate(obs, action)).sum().backward()

        ratios = []
        for fn in (train, lambda: agent.step(obs)):
            split, where = [], []
            for _ in range(ROUNDS):
                with groups.split_min_rows(0):
                    split.append(per_step_ms(fn, 1, 100))
                with groups.split_min_rows(math.inf):
                    where.append(per_step_ms(fn, 1, 100))
            ratios.append(statistics.median(split) / statistics.median(where))
        lines.append(f"{n} rows: evaluate + backward {ratios[0]:.2f}x, step {ratios[1]:.2f}x")
    print(f"\n{hidden}x{hidden}, two groups, the split to every member on every row: " + "; ".join(lines))
    assert ratios[0] > 0
