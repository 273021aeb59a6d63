"""Bad configuration fails before any process starts, with one line naming the field."""

from __future__ import annotations

import json
import socket
import tomllib

import pytest

from shared.config import endpoints, loading, schema
from shared.replay.rate_limiter import RateLimiterConfig
from shared.replay.selectors import PrioritizedConfig
from shared.replay.sequences import SequenceStorageConfig
from shared.replay.storage import StorageConfig
from shared.replay.transitions import TransitionStorageConfig
from tests.pipeline import CONFIGS, rlpipe

DEFAULT = CONFIGS / "cartpole_ppo.toml"


@pytest.mark.parametrize("override, names", [
    ("sampler.cuont=2", "sampler.cuont"),
    ("sampler.count=0", "sampler.count"),
    ("action_server.count=0", "action_server.count"),
    ("sampler.envs=\"many\"", "sampler.envs"),
    ("algo.lr=\"fast\"", "algo.lr"),
    ("sampler.alternating=1", "sampler.alternating"),
    ("env.id=\"CartPol-v1\"", "env.id"),
    ("env.id=\"nomodule:make\"", "env.id"),
    ("algo.name=\"sarsa\"", "algo.name"),
    ("run.device=\"tpu\"", "run.device"),
    ("network.host=\"0.0.0.0\"", "network.host"),
    ("network.transport=\"udp\"", "network.transport"),
    ("bogus.key=1", "bogus"),
    ("learner.batch_segments=3", "learner.batch_segments"),
    ("replay.store_steps=true", "replay.store_steps"),  # PPO learns from segments, not n-step windows
    ("replay.alpha=\"high\"", "replay.alpha"),  # a key of a part's config (PrioritizedConfig.alpha)
    ("replay.sequence_length=true", "replay.sequence_length"),
])
def test_bad_value_is_one_line_naming_the_field(override, names):
    with pytest.raises(schema.ConfigError) as err:
        loading.load(DEFAULT, [override])
    message = str(err.value)
    assert names in message and "\n" not in message


@pytest.mark.parametrize("overrides, names", [
    (["placement.sampler='b'"], "network.transport"),  # several nodes talk over TCP
    (["placement.sampler='b c'", "network.transport='tcp'"], "placement.sampler"),
    (["placement.action_server='b'", "sampler.inference='server'", "network.transport='tcp'"],
     "placement.action_server"),  # it shares step slots with the samplers
    (["learner.count=3"], "learner.count"),  # 32 env columns a batch: no equal thirds
    (["learner.count=0"], "learner.count"),
])
def test_bad_placements_and_learner_counts_are_one_line_naming_the_field(overrides, names):
    with pytest.raises(schema.ConfigError) as err:
        loading.load(DEFAULT, overrides)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_port_in_use_is_reported_before_launch(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = rlpipe("launch", str(DEFAULT), "--set", f"run.runs_dir='{tmp_path}'", "--set",
                     f"network.metrics_port={port}", "--detach")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "network.metrics_port" in lines[0] and "in use" in lines[0]
    assert list(tmp_path.iterdir()) == [], "no run directory may be made for a bad config"


def test_cli_rejects_unknown_key_without_starting_anything(tmp_path):
    out = rlpipe("launch", str(DEFAULT), "--set", f"run.runs_dir='{tmp_path}'", "--set", "sampler.count=0",
                 "--detach")
    assert out.returncode == 2
    assert out.stderr.strip() == "rlpipe: config error: sampler.count = 0: must be >= 1"
    assert list(tmp_path.iterdir()) == []


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(schema.ConfigError, match="does not exist"):
        loading.load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sampler\ncount = 2\n")
    with pytest.raises(schema.ConfigError, match="not valid TOML"):
        loading.load(bad)


def test_overrides_and_resolved_config_round_trip():
    exp = loading.load(DEFAULT, ["sampler.count=3", "algo.lr=3e-4", "model.hidden_sizes=[32, 32]"])
    assert exp.sampler.count == 3 and exp.algo.lr == 3e-4 and exp.model.hidden_sizes == (32, 32)
    assert loading.from_dict(tomllib.loads(loading.dumps(exp))) == exp


def test_every_replay_key_sets_its_parts_config_and_round_trips():
    # [replay] stays flat: each key sets one field of one part's config (ReplayConfig.KEYS).
    keys = {"table": "prioritized", "capacity": 50000, "n_step": 2, "gamma": 0.9, "store_steps": True,
            "frame_store": True, "sequence_length": 20, "sequence_period": 10, "alpha": 0.5, "beta0": 0.5,
            "beta_final": 0.9, "beta_steps": 7, "weight_norm": "table_min", "samples_per_insert": 4.0,
            "min_size_to_sample": 500, "error_buffer": 100.0, "max_policy_lag": 3, "release_on_sample": True,
            "peer_timeout_s": 5.0, "persist": True, "snapshot_interval_s": 60.0}
    exp = loading.load(CONFIGS / "cartpole_rainbow.toml",
                       [f"replay.{k}={json.dumps(v)}" for k, v in keys.items()])
    r = exp.replay
    assert r.flat() == keys
    assert r.storage == StorageConfig(capacity=50000, frame_store=True)
    assert r.transitions == TransitionStorageConfig(n_step=2, gamma=0.9, store_steps=True)
    assert r.sequences == SequenceStorageConfig(length=20, period=10)
    assert r.prioritized == PrioritizedConfig(alpha=0.5, beta0=0.5, beta_final=0.9, beta_steps=7, weight_norm="table_min")
    assert r.rate_limiter == RateLimiterConfig(samples_per_insert=4.0, min_size_to_sample=500, error_buffer=100.0)
    assert loading.from_dict(tomllib.loads(loading.dumps(exp))) == exp


SAVED_REPLAY = """[replay]
table = "uniform"
capacity = 100000
n_step = 5
gamma = 0.99
store_steps = false
frame_store = false
sequence_length = 80
sequence_period = 40
alpha = 0.6
beta0 = 0.4
beta_final = 1.0
beta_steps = 100000
weight_norm = "batch_max"
samples_per_insert = 8.0
min_size_to_sample = 1000
error_buffer = 0.0
max_policy_lag = 4
release_on_sample = false
peer_timeout_s = 10.0
persist = true
snapshot_interval_s = 300.0
"""
"""cartpole_dqn's [replay] as a run directory's config.toml holds it (``dumps``)."""


def test_a_run_directorys_replay_section_loads_and_is_written_back_the_same():
    exp = loading.load(CONFIGS / "cartpole_dqn.toml")
    text = loading.dumps(exp)
    start = text.index("[replay]\n")
    assert text[start:start + len(SAVED_REPLAY) + 2] == SAVED_REPLAY + "\n["
    raw = tomllib.loads(loading.dumps(exp))
    raw["replay"] = tomllib.loads(SAVED_REPLAY)["replay"]
    assert loading.from_dict(raw) == exp


def test_unknown_replay_key_lists_the_flat_keys():
    with pytest.raises(schema.ConfigError) as e:
        loading.load(DEFAULT, ["replay.capcity=4"])
    assert str(e.value) == (
        "unknown key replay.capcity (did you mean 'capacity'?) (allowed: table, capacity, n_step, gamma, "
        "store_steps, frame_store, sequence_length, sequence_period, alpha, beta0, beta_final, beta_steps, "
        "weight_norm, samples_per_insert, min_size_to_sample, error_buffer, max_policy_lag, release_on_sample, "
        "peer_timeout_s, persist, snapshot_interval_s)")


def test_tcp_endpoints_bind_loopback_by_default(tmp_path):
    exp = loading.load(DEFAULT, ["network.transport=\"tcp\""])
    assert endpoints.endpoint(exp, tmp_path, "replay").startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize("host, ok", [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("localhost", True),
                                      ("127.evil.example", False), ("0.0.0.0", False), ("10.0.0.1", False),
                                      ("127.0.0.1.nip.io", False)])
def test_only_a_parsed_loopback_address_binds_without_bind_any(host, ok):
    overrides = [f"network.metrics_host='{host}'"]
    if ok:
        assert loading.load(DEFAULT, overrides).network.metrics_host == host
    else:
        with pytest.raises(schema.ConfigError, match="network.metrics_host"):
            loading.load(DEFAULT, overrides)


def test_a_run_directory_made_before_a_key_was_removed_still_loads(tmp_path):
    """env.seed (never read: run.seed seeds the envs) was removed; every older run's resolved
    config holds its default 0, and `launch --resume`, `evaluate` and `results` must read it."""
    stored = tmp_path / "config.toml"
    stored.write_text(DEFAULT.read_text().replace("[env]\n", "[env]\nseed = 0\n", 1))
    assert loading.load(stored).env.id == "CartPole-v1"
    with pytest.raises(schema.ConfigError, match=r"^env\.seed was removed: run\.seed seeds the envs$"):
        loading.load(DEFAULT, ["env.seed=3"])
