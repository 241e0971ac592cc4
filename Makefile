# One-command set-up on a fresh machine: a virtual environment with torch pinned to the
# version whose CPU wheel this machine image carries (an unpinned torch pulls a CUDA build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: setup demo test bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,bench,integrations,s3,crypto]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python examples/demo.py --store demo-store

test: setup
	$(BIN)/python -m pytest -q -n 2

bench: setup
	$(BIN)/python bench/bench_core.py

clean:
	rm -rf $(VENV) demo-store bench/out .pytest_cache .hypothesis
