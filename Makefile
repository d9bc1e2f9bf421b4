VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpool-installed

.PHONY: demo test lint bench setup clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	scripts/bootstrap.sh

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvpool demo

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20

bench: $(STAMP)
	$(BIN)/kvpool bench store-path

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
