# Entry points: `make demo` and `make test` work on a fresh machine with Python 3.11+ and gcc.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The package alone (what the demo needs); STAMP adds the test extra on top.
BASE   := $(VENV)/.installed-base
SOURCES := pyproject.toml setup.py $(wildcard armdb/_core/*.pyx armdb/_core/*.pxd)

.PHONY: demo test reliability bench lint clean build

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# editable_mode=compat: a path entry in site-packages rather than an import hook, so
# that type checkers (mypy, pyright) find armdb and its py.typed in this checkout.
EDITABLE := --config-settings editable_mode=compat

$(BASE): $(PY) $(SOURCES)
	$(PY) -m pip install -q $(EDITABLE) -e .
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install -q $(EDITABLE) -e '.[test]'
	touch $(STAMP)

build: $(STAMP)

# Only the package: the demo needs numpy, msgpack and cryptography, not the test and
# notebook extras (pandas, matplotlib, ipykernel), which made a first `make demo` slow.
demo: $(BASE)
	$(PY) -m armdb demo

test: $(STAMP)
	$(PY) -m pytest -q

reliability: $(STAMP)
	ARMDB_KILLS=2000 ARMDB_CRASH_STATES=200000 ARMDB_HYP_EXAMPLES=5000 $(PY) -m pytest -q -m 'slow or not slow' tests

# The asv suite once over (quick), then the side-by-side run against the peers (SPEC C3).
bench: $(STAMP)
	$(PY) -m pip install -q $(EDITABLE) -e '.[test,bench]'
	cd asv_bench && $(abspath $(VENV))/bin/asv machine --yes > /dev/null
	cd asv_bench && $(abspath $(VENV))/bin/asv run --python=same --quick
	$(PY) -m armdb bench --quick

lint: $(STAMP)
	$(PY) -m pip install -q ruff mypy
	$(VENV)/bin/ruff check armdb tests
	$(VENV)/bin/mypy

clean:
	rm -rf build armdb/_core/*.c armdb/_core/*.so $(VENV) .pytest_cache
