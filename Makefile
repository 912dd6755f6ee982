# Two entry points that work on a fresh machine (Python 3.11, no GPU, no torch installed):
#   make demo   -- set up .venv and run the main job (megatron-mis demo --compare: stale rollouts,
#                  none vs bypass PPO, table and runs/demo/report.png; about 2 min on 2 idle cores)
#   make test   -- set up .venv and run the whole test suite
# torch==2.13.0 is installed first, on its own, so that nothing pulls a CUDA build of torch.
# The package goes in with its [demo] extra (matplotlib, tqdm: the demo, study, plots and analyze)
# and [test] (pytest, hypothesis); a training container needs neither (`pip install .`).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.megatron-mis-installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test,demo]"
	touch $(STAMP)

demo: setup
	$(BIN)/megatron-mis demo --compare

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python benchmarks/bench_mis.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis *.egg-info
