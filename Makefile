# Set-up lives here so that a fresh clone needs only `make bench` or `make test`.
# VENV may point at an existing environment (e.g. one holding a CUDA build of torch 2.13.0).
# The exact versions come from constraints.txt; the package itself declares ranges (pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.benchlib-installed
ARGS ?=

.PHONY: bench test check lab docs install bytecode lowest clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt tools/install.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python tools/install.py
	@touch $@

## benchlib's bytecode, for every process a run or the suite starts: an editable install compiles none, and where
## PYTHONDONTWRITEBYTECODE is set no process writes it, so each would compile what it imports again (about 0.7 s).
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q benchlib

## Run every notebook on the best available device; results land in results/<run-id>/.
bench: bytecode
	$(BIN)/benchlib run --device auto $(ARGS)

## The test suite (CI runs exactly this): the tests that may share the machine on WORKERS processes (pytest-xdist,
## one per core), then the `serial` ones alone in this process, whose figures a neighbour would change (an xdist
## worker's own thread, a busy core). Both parts run; either failing fails it (pytest's exit 5, no test selected,
## counts as none failed). The 20 slowest of each are listed.
WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest --durations=20
# $(call suite,AND): the tests `not serial AND` on WORKERS processes, then those `serial AND` alone.
define suite
	@status=0; \
	$(PYTEST) -n $(WORKERS) --dist worksteal -m "not serial$(1)" $(ARGS) || status=$$?; \
	$(PYTEST) -m "serial$(1)" $(ARGS) || { code=$$?; [ $$code = 5 ] || status=$$code; }; \
	[ $$status != 5 ] || status=0; exit $$status
endef
test: bytecode
	$(call suite,)

## The inner loop: every test that starts no process (tests/conftest.py fails one that does without the `slow` mark).
check: bytecode
	$(call suite, and not slow)

## The fast tests in an environment where every declared dependency is at the lowest version its range allows
## (uv's lowest-direct resolution, checked by tools/check_lowest.py), so each lower bound in pyproject.toml is tested.
## About 6 GB in $(LOWEST): torch's lowest release comes from PyPI as a CUDA build. ARGS go to pytest.
LOWEST ?= .venv-lowest
lowest: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt uv
	@test -x $(LOWEST)/bin/python || $(PYTHON) -m venv $(LOWEST)
	$(BIN)/uv pip install --quiet --python $(LOWEST)/bin/python --resolution lowest-direct -e . \
		$$(grep -E '^(pytest|pytest-timeout|hypothesis)==' constraints.txt)
	$(LOWEST)/bin/python tools/check_lowest.py
	$(LOWEST)/bin/python -m pytest -m "not slow" $(ARGS)

## JupyterLab on working copies of the notebooks in lab/ (git-ignored): outputs and edits never touch notebooks/;
## runs go to results/ (linked into lab/). ARGS go to jupyter lab; as root --allow-root is added.
lab: $(STAMP)
	$(BIN)/benchlib lab --dir lab -- $(ARGS)

## The documentation site from README.md's pages in docs/ (mkdocs, Material theme) into site/: open site/index.html.
## --strict: a link to a page or heading that does not exist fails the build (tests/test_docs.py runs it too).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	@echo "site: $(CURDIR)/site/index.html"

clean-venv:
	rm -rf $(VENV)
