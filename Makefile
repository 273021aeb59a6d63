# rlpipe — the README's first commands: `make run` and `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
CONFIG ?= deploy/configs/cartpole_ppo.toml

.PHONY: install run test test-fast test-all bench gpu-check clean-runs

# torch first, pinned to the CPU wheel this machine carries, only when no torch is importable:
# a bare `torch` requirement would pull a multi-GB CUDA build; a user's own (CUDA) torch is kept.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -q -e ".[test,atari,minatar,mujoco,cluster,envpool,stats,wandb,tune,export,hub,marl]"

run: install
	$(PYTHON) -m shared.launch.cli launch $(CONFIG)

# One pass on both cores (pytest-xdist, whole modules a worker so module fixtures run once; the
# conftest hands out the learning modules first): every test, live and learning checks included,
# is sized to pass beside another test's processes (docs/benchmarks.md, "make test on two workers").
# --no-loadscope-reorder: xdist >= 3.6 otherwise re-sorts the modules by their number of tests,
# which put the one-test learning modules (R2D1's, 52-78 s) last, alone on one worker.
UNIT = -m "not learning and not live"

test: install
	$(PYTHON) -m pytest -q tests --ignore=tests/bench -n 2 --dist loadscope --no-loadscope-reorder --durations=25

# The unit tier for iterating: no learning checks, no test that starts runs or processes.
test-fast:
	$(PYTHON) -m pytest -q tests --ignore=tests/bench $(UNIT) -n 2

bench: install
	$(PIP) install -q -e ".[bench]"
	$(PYTHON) -m pytest -q -s tests/bench -m bench

# On a CUDA machine (after `make install`): a few minutes, one table, written to runs/gpu_check/.
# Without CUDA it says so in one line; GPU_CHECK_ARGS="--device cpu --quick" runs a tiny version.
gpu-check:
	$(PYTHON) -m tests.bench.gpu_check $(GPU_CHECK_ARGS)

clean-runs:
	rm -rf runs
