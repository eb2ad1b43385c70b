# Every target sets itself up: a fresh clone needs nothing but python3 (>= 3.10) and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
STAMP  := $(VENV)/.stamp
# torch's build for this machine, said in one line: the CPU build where no NVIDIA GPU is
# here, else the default (CUDA) one; TORCH_INDEX_URL=<index> chooses, a torch already in
# .venv is kept (scripts/torch_build.py).
TORCH  := $(PY) scripts/torch_build.py --constraint constraints.txt

.PHONY: run test test-quick test-long test-sim test-infra infra-packages lint typecheck unit bench gpu-check clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The package (editable) plus what the tests and linters need. Re-run when the
# dependency lists change.
$(STAMP)-test: $(VENV)/bin/python pyproject.toml constraints.txt scripts/torch_build.py
	$(TORCH)
	$(PIP) -e ".[test]"
	@touch $@

$(STAMP)-run: $(VENV)/bin/python pyproject.toml constraints.txt scripts/torch_build.py
	$(TORCH)
	$(PIP) -e .
	@touch $@

$(STAMP)-infra: $(STAMP)-test
	$(PIP) -e ".[test,infra]"
	@touch $@

$(STAMP)-bench: $(STAMP)-test
	$(PIP) -e ".[test,bench]"
	@touch $@

## make run: set up .venv and run the main job, `anydevice doctor` (30 s of measuring), here.
run: $(STAMP)-run
	$(VENV)/bin/anydevice doctor

## make test: the whole suite, lint and type checks included. The tests run on every usable
## core (pytest-xdist), those that start several processes one at a time on one of them.
test: lint unit

unit: $(STAMP)-test sim-build
	$(PY) -m pytest -n auto -m "not long"

## make test-long: the tests marked long, minutes each (the resume soak, whole programs run
## under the simulator, the race detection table); CI runs it after `make test`.
test-long: $(STAMP)-test sim-build
	$(PY) -m pytest -n auto -m long

## make test-sim: the tests marked cuda (written for a GPU) on two simulated CUDA GPUs with
## the stream race detector on: a race fails its test; what only a physical GPU gives is
## skipped, saying why (real_gpu marks). A minute or more; make test-long runs it too.
## Only the files with cuda tests are collected (tests/infra aside: make test-infra's).
CUDA_TEST_FILES = $(shell grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | grep -v '^tests/infra/' | sort)
test-sim: $(STAMP)-test sim-build
	$(PY) -m pytest -p anydevice.testing.pytest_plugin --sim-cuda --sim-devices 2 --sim-capacity 4GiB -m cuda -rs $(CUDA_TEST_FILES)

## make test-quick: the tests not marked slow (no multi-process launches), on every core.
test-quick: $(STAMP)-test sim-build
	$(PY) -m pytest -n auto -m "not slow and not long"

# The simulated accelerator's library, built before the tests (once per checkout, torch and
# compiler; a few seconds when built), not inside the first test that needs it. Where it
# cannot be built (no compiler) the tests that need it skip, saying why.
.PHONY: sim-build
sim-build: $(STAMP)-test
	-$(PY) -m anydevice.testing --build

## make test-infra: real infrastructure (tests/infra, not part of `make test`): a notebook in a
## Jupyter kernel, two hosts in network namespaces, a SLURM cluster of two nodes. As root it
## installs the Debian packages it needs; a part that cannot run is skipped saying why.
test-infra: $(STAMP)-infra infra-packages
	$(PY) -m pytest tests/infra -v -rs -p no:cacheprovider --timeout 400

INFRA_DEBS := iproute2 util-linux slurmctld slurmd slurm-client munge
infra-packages:
	@if [ "$$(id -u)" != 0 ]; then \
		echo "test-infra: not root, installing no Debian packages (the parts needing them skip)"; \
	elif ! command -v apt-get >/dev/null; then \
		echo "test-infra: no apt-get, installing no Debian packages (the parts needing them skip)"; \
	else \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(INFRA_DEBS) >/dev/null \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends $(INFRA_DEBS) >/dev/null; } \
		|| echo "test-infra: apt-get could not install $(INFRA_DEBS) (the parts needing them skip)"; \
	fi

lint: $(STAMP)-test
	$(VENV)/bin/ruff check src tests benchmarks examples scripts
	$(VENV)/bin/ruff format --check src tests benchmarks examples scripts
	$(VENV)/bin/mypy

## make bench: side-by-side benchmarks against plain torch and the peers.
bench: $(STAMP)-bench
	$(PY) benchmarks/run.py

## make gpu-check: cuda-marked tests and GPU benchmarks (no install: PYTHONPATH=src), the
## whole report under benchmarks/results/gpu-check/<gpu-model>-x<count>/.
gpu-check:
	bash scripts/gpu-check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist
