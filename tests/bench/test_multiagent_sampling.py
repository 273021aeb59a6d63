"""Benchmark: a sampler stepping the N agents of PettingZoo Parallel envs against the same
sampler stepping as many single-agent gymnasium envs of the same cost an agent-step (issue 39's
target: >= 0.8x), measured in one run, alternating, three rounds each, medians compared.

Both envs are tests/busy_agents_for_tests.py's: every agent-step spins ``cost_us`` (the env's own
work), so the two setups do the same env work and differ only in the backend's per-agent
bookkeeping (dicts in and out of PettingZoo's API, one env for N columns). The pipeline runs 1
sampler x 16 columns (4 envs x 4 agents, or 16 envs), local inference, a DQN learner that never
samples in the window (``min_size_to_sample`` above what is inserted), so sampling is what is
measured. Steps/s from the samplers' Prometheus counter (a column's step is one env step).
Run with `make bench`.
"""

from __future__ import annotations

import os

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
