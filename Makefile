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

# Two workers, a test file each at a time (tests of one file share fixtures): the suite's
# many single-process tests leave a core idle otherwise. tests/conftest.py hands out the
# files with slow tests first.
test: setup
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

lint: setup
	$(VENV)/bin/ruff check dpcfl_flwr tests
	$(VENV)/bin/mypy dpcfl_flwr
