# The two entry points of README.md; each does the whole set-up first on a fresh machine.
VENV := .venv
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test lint

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

demo: setup
	$(VENV)/bin/dpcfl simulate --config examples/quick.toml --out results/quick --overwrite

test: setup
	$(VENV)/bin/python -m pytest -q

lint: setup
	$(VENV)/bin/ruff check dpcfl_flwr tests
	$(VENV)/bin/mypy dpcfl_flwr
