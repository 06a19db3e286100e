# One-command set-up: `make train` and `make test` create or refresh .venv first.
# PyTorch is installed before batchrl so that pip never resolves `torch` on its
# own (an unpinned torch pulls a multi-GB CUDA build). Override for a GPU box:
#   make test TORCH_PIP_ARGS="--index-url <PyTorch's wheel index for your CUDA>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
CONFIG ?= halfcheetah
TRAIN_ARGS ?=
PYTEST_ARGS ?=
# Test processes side by side (pytest-xdist; "0" runs the suite in this process).
TEST_WORKERS ?= auto

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv train test test-all test-fast bench clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -q -e ".[test,bench,video,ray,atari,native]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py --config $(CONFIG) $(TRAIN_ARGS)

# Every test but those marked slow (learning runs, long end-to-end checks).
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

# Every test, the slow ones too: what CI runs (.ci/run).
test-all: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The quick loop: also leaves out the tests that run commands or a Ray cluster (e2e).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not e2e" \
		$(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/envstep.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
