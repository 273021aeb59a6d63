"""Benchmark: a sampler stepping the N agents of PettingZoo Parallel envs against the same
sampler stepping as many single-agent gymnasium envs of the same cost an agent-step (issue 39's
target: >= 0.8x), measured in one run, alternating, three rounds each, medians compared.

Both envs are tests/busy_agents_for_tests.py's: every agent-step spins ``cost_us`` (the env's own
work), so the two setups do the same env work and differ only in the backend's per-agent
bookkeeping (dicts in and out of PettingZoo's API, one env for N columns). The pipeline runs 1
sampler x 16 columns (4 envs x 4 agents, or 16 envs), local inference, a DQN learner that never
samples in the window (``min_size_to_sample`` above what is inserted), so sampling is what is
measured. Steps/s from the samplers' Prometheus counter (a column's step is one env step).

The last case times a Connect Four sampler whose opponent seat plays a pool of past versions
against one that plays the latest version, in one process (serial mode's parts).
Run with `make bench`.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.bench.test_pipeline_throughput import sampling_rate
from tests.pipeline import rate_medians

pytestmark = pytest.mark.bench
pytest.importorskip("pettingzoo")

AGENTS, COLUMNS, WINDOW_S = 4, 16, 8.0
CHEAP = ["replay.capacity=2000000", "replay.min_size_to_sample=2000000", "replay.samples_per_insert=0.0",
         "run.target_return=1e9", "sampler.inference=local", "sampler.count=1", f"sampler.envs={COLUMNS}",
         "sampler.horizon=32", "sampler.ring=2"]


def setups(cost_us: float) -> dict[str, list[str]]:
    return {"single": ["env.id='tests.busy_agents_for_tests:make_single'",
                       f"env.kwargs='{{\"cost_us\": {cost_us}}}'"],
            "agents": ["env.id='pettingzoo:tests.busy_agents_for_tests'",
                       f"env.kwargs='{{\"agents\": {AGENTS}, \"cost_us\": {cost_us}}}'"],
            # Two agent groups: the agent_group leaf in every column and one network a group, rows
            # split by group in the numpy actor (shared.agents.acting.NumpyGroupsActor).
            "groups": ["env.id='pettingzoo:tests.busy_agents_for_tests'",
                       f"env.kwargs='{{\"agents\": {AGENTS}, \"cost_us\": {cost_us}}}'",
                       "env.groups={ even = 'agent_[02]', odd = 'agent_[13]' }"]}


def steps_per_s(tmp_path, overrides: list[str]) -> float:
    return sampling_rate(tmp_path, "cartpole_dqn.toml", [*CHEAP, *overrides], WINDOW_S)


@pytest.mark.parametrize("cost_us", [20.0, 100.0])
def test_a_sampler_steps_the_agents_of_a_parallel_env_near_as_fast_as_single_agent_envs(tmp_path, cost_us):
    both = setups(cost_us)
    rates = {name: [] for name in both}
    for i in range(3):
        for name in both if i % 2 == 0 else reversed(both):  # neither always runs first
            rates[name].append(steps_per_s(tmp_path / f"{name}{i}", both[name]))
        print(f"\nround {i}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    medians = rate_medians(rates, "single", {
        "single": f"1 sampler x {COLUMNS} single-agent envs, {cost_us:g} us a step ({len(os.sched_getaffinity(0))} CPUs)",
        "agents": f"1 sampler x {COLUMNS // AGENTS} Parallel envs x {AGENTS} agents, {cost_us:g} us an agent-step",
        "groups": f"the same with two agent groups (env.groups), {cost_us:g} us an agent-step"})
    assert min(medians.values()) > 0


POOL_VERSIONS, POOL_SEGMENTS, POOL_WARMUP = 8, 10, 3


def pool_steps_per_s(tmp_path, pool: str, stacked: bool, scripted: str = "") -> float:
    """Env steps/s of connect_four_pool_ppo's sampler (64 columns, 32 boards, horizon 32, local
    inference, one torch thread) whose opponent seat draws from a pool of 8 versions by ``pool``,
    its copies acting in one stacked pass or each on its own boards, ``scripted`` the
    ``selfplay.scripted`` table (empty: none): the serial-mode parts in this
    process (``Sampler``, ``LocalActions``, ``Opponent``), POOL_SEGMENTS segments after
    POOL_WARMUP, so sampling alone is timed."""
    import numpy as np
    import torch

    from services.build import agent_info, env_probe, make_agent
    from services.sampler.local import LocalActions
    from services.sampler.opponent import sampler_opponent
    from services.sampler.sampler import Sampler
    from shared.agents.actor import Actor
    from shared.agents.stacked import stacked_actor
    from shared.config import loading
    from shared.config.topology import topology
    from shared.transport.params import ModuleState, field_name
    from shared.transport.pool import PoolFiles
    from tests.pipeline import CONFIGS
    from tests.test_memory import FixedParams
    from tests.test_selfplay_pool import Announced

    torch.set_num_threads(1)
    tmp_path.mkdir(parents=True)
    exp = loading.load(CONFIGS / "connect_four_pool_ppo.toml", [f"selfplay.pool='{pool}'", "sampler.ring=2",
                                                                 *([f"selfplay.scripted={scripted}"] if scripted else [])])
    probe = env_probe(exp)
    current, past = make_agent(exp, probe), make_agent(exp, probe)
    files = PoolFiles(tmp_path, POOL_VERSIONS)
    for version in range(1, POOL_VERSIONS + 1):
        with torch.no_grad():
            for p in past.parameters():
                p.add_(0.01 * torch.randn(p.shape))
        files.add(version, {field_name(k): t.numpy() for k, t in past.state_dict().items()})
    topo = topology(exp)
    sampler = Sampler(exp.sampler, exp.env, topo, 0, agent_info(exp), "poolbench", shared_memory=False)
    seeds = np.random.SeedSequence(0).spawn(2)

    def make_copy():
        other = make_agent(exp, probe).eval()
        return Actor(other, seeds[0].spawn(1)[0]), ModuleState(other)
    sampler.opponent = sampler_opponent(exp, tmp_path, sampler, make_copy, seeds[1],
                                        stacked_actor if stacked else None)
    actions = LocalActions(Actor(current, topo.acting_seed("sampler", 0)), sampler, FixedParams(), topo.total_envs,
                           sampler.opponent)
    sink = Announced()
    sampler.start(actions)
    try:
        for _ in range(POOL_WARMUP):
            sampler.collect_segment(actions, sink)
        t0 = time.perf_counter()
        for _ in range(POOL_SEGMENTS):
            sampler.collect_segment(actions, sink)
        return POOL_SEGMENTS * exp.sampler.horizon * exp.sampler.envs / (time.perf_counter() - t0)
    finally:
        sampler.close()
        probe.close()


def test_a_sampler_against_a_pool_of_versions_to_one_against_the_latest(tmp_path):
    """What a pool of past versions costs a Connect Four sampler against ``latest`` (one version in
    play), its opponent's copies acting each in its own forward pass or all in one stacked pass
    (shared/agents/stacked.py), and with the heuristic holding a quarter of the games
    (``selfplay.scripted``, its lookahead in the sampler's loop): medians of 3 alternating rounds,
    ratios to ``latest`` measured in this run."""
    setups = {"latest": ("latest", True), "uniform, a pass a copy": ("uniform", False),
              "uniform, stacked": ("uniform", True),
              "uniform, stacked, heuristic 25%": ("uniform", True, "{ heuristic = 0.25 }")}
    rates = {name: [] for name in setups}
    for i in range(3):
        for name in setups if i % 2 == 0 else reversed(setups):  # none always runs first
            rates[name].append(pool_steps_per_s(tmp_path / f"{name}{i}".replace(" ", ""), *setups[name]))
        print(f"\nround {i}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    medians = rate_medians(rates, "latest", {name: f"connect_four_pool_ppo, 64 columns, pool {name}"
                                             for name in setups})
    assert min(medians.values()) > 0
