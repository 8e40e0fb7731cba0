# `make demo` and `make test` set everything up from nothing: a .venv with the exact dev pins.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint docs test test-fast bench clean

# compileall: bytecode for every installed module, in parallel (~30 s on 2 cores; pip's
# own pass is serial, hence its --no-compile). Without it, where PYTHONDONTWRITEBYTECODE is
# set, every process compiled torch again on import: 9-11 s before its first line, 3.6-3.9 s
# with it. A file that does not compile (torch's Python 3.12-only test helper) is only left
# uncompiled, hence `|| true`.
$(STAMP): requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -r requirements-dev.txt  # pip byte-compiles serially: ~185 s, not ~50
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

setup: $(STAMP)

# Each run gets its own runs/<name>-<time>/ (report.png included); the paths are printed.
demo: $(STAMP)
	$(BIN)/scaletrain train configs/default.toml

# ruff's rules and format are configured in pyproject.toml ([tool.ruff]).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link or anchor, and the config
# reference and API page are generated from the code (docs/hooks/generated.py). Output: site/.
# NO_MKDOCS_2_WARNING: mkdocs-material's end-of-life banner, not a warning about the docs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# --durations: the slowest tests are named in every run (budget: make test <= 12 min on 2 cores).
# Two pytest workers, a test file each at a time (pytest-xdist, --dist loadfile: a file's
# module fixtures and its jobs stay in one worker); a serial run leaves a core idle while
# a test waits on its processes. tests/conftest.py deals the heaviest files out first.
XDIST = -n 2 --dist loadfile
test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) --durations=25 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" tests

bench: $(STAMP)
	$(BIN)/pip install -q -r requirements-bench.txt
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/scaling.py
	$(BIN)/python bench/peers.py
	$(BIN)/python bench/peers.py --preset hf-llama
	$(BIN)/python bench/defaults.py
	$(BIN)/python bench/precision_accum.py
	$(BIN)/python bench/loader.py
	$(BIN)/python bench/own_data.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/allocator.py
	$(BIN)/python bench/layouts.py --bubble
	$(BIN)/python bench/ps.py
	$(BIN)/python bench/distill.py

clean:
	rm -rf $(VENV) runs site
