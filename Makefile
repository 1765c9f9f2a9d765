# Two commands do all set-up: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
# CPU wheel by default; a GPU host overrides, e.g. `make TORCH_SPEC="torch==2.13.0" run`.
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA  ?=
CONFIG ?= configs/tiny.toml
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench soak lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(BIN)/pip install -q $(PIP_EXTRA) -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/scd run $(CONFIG)

test: $(STAMP)
	$(BIN)/ruff check scd tests bench
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

soak: $(STAMP)
	SCD_SOAK_KILLS=$${SCD_SOAK_KILLS:-50} $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/test_crash_loop.py

bench: $(STAMP)
	$(BIN)/python -m bench.run

lint: $(STAMP)
	$(BIN)/ruff check scd tests bench
	$(BIN)/ruff format --check scd tests bench

clean:
	rm -rf $(VENV) runs
