# kvserve: `make serve` runs the server on the default model; `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=

.PHONY: install serve test lint bench clean

$(BIN)/kvserve: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(BIN)/kvserve

install: $(BIN)/kvserve

serve: install
	$(BIN)/kvserve serve $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check kvserve tests benchmarks tools

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
