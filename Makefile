# The two commands in the README:
#   make demo   install everything, then run the project's main job on built-in defaults
#   make test   install everything, lint (ruff check + format --check), then run the test suite
#   make format apply ruff's fixes and formatting
# Both are idempotent: the install step is skipped when .venv is already up to date.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export WANDB_MODE ?= offline
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: install demo lint format test test-fast

install:
	bash scripts/install.sh

demo: install
	$(PY) -m scripts.demo $(ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test: lint
	$(PY) -m pytest tests -q $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest tests -q -m "not slow and not vllm" $(PYTEST_ARGS)
