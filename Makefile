# One Python 3.11+ and nothing else: `make serve` / `make test` create .venv and install into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch (pinned: an unpinned torch pulls a multi-GB CUDA build).
# GPU users: see docs/deploy.md (CUDA torch + `pip install -e '.[gpu]'`).
TORCH ?= torch==2.13.0

.PHONY: venv serve test lint bench docs clean

$(BIN)/flowprefill: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,docs]'
	touch $@

venv: $(BIN)/flowprefill

serve: venv
	$(BIN)/flowprefill serve

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: venv
	$(BIN)/flowprefill bench prefill

docs: venv
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site bench-results
