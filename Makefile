# The one entry point: every install step lives here or in pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The suite runs on three workers, a test file to each (the longest files first, see
# tests/conftest.py): on two cores, a third keeps them busy while a test waits (a heartbeat
# timeout, a peer's deadline). PYTEST_ARGS= runs it serially; `make test-stress` loads the
# machine.
PYTEST_ARGS ?= -n 3 --dist loadfile
# Where `make docs` builds the site; the suite's link checks read it there.
SITE ?= site

.PHONY: install browser lint format test test-stress docs demo bench bench-quick soak gpu-check clean

install: $(STAMP)

# --no-compile: pip would compile every module of every package (torch's thousands: half of
# the install's time); instead what an aiodist process imports is compiled once, here, and
# the suite writes the bytecode of the rest as it first imports it (see `test`).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The pinned CPU build first, so nothing pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.[dev,docs]'
	env -u PYTHONDONTWRITEBYTECODE $(PY) -c 'import aiodist, aiodist.sync, aiodist.rpc'
	touch $(STAMP)

# The dashboard's browser test: chromium and its driver from the distribution, where
# missing and where apt-get can install them (as root). Without them that test skips.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null \
		|| echo "browser: could not install chromium; the dashboard's browser test will skip"; \
	else echo "browser: no chromium; the dashboard's browser test will skip"; fi

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) aiodist/_tools/layers.py
	@if [ -f aiodist/_tools/gen_sync.py ]; then $(PY) -m aiodist._tools.gen_sync --check; fi
	$(PY) -m aiodist._tools.gen_settings --check

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Bytecode is written: the suite starts hundreds of interpreters, and where
# PYTHONDONTWRITEBYTECODE is set each of them would compile again what it imports (aiodist's
# sources about 0.25 s of CPU apiece, torch's several seconds).
# lint (mypy: one core) and docs run side by side, then the suite.
test: install browser
	$(MAKE) --no-print-directory -j2 --output-sync=target lint docs
	DOCS_SITE=$(CURDIR)/$(SITE) env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest $(PYTEST_ARGS)

# The tests that start processes, 5 rounds in a row, in parallel, with a CPU burner on
# every core; every failure of every round is reported (nothing runs again). It must pass
# clean before any test could be marked flaky. STRESS_ARGS="--rounds 2 tests/compat" etc.
STRESS_ARGS ?=

test-stress: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m tests.stress $(STRESS_ARGS)

# The documentation site (mkdocs.yml), offline, into site/: --strict makes any warning,
# broken link or missing reference fail it. NO_MKDOCS_2_WARNING: Material's banner about
# MkDocs 2 (we pin mkdocs<2), which is no warning of the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $(SITE)

demo: install
	$(VENV)/bin/aiodist run -n 4 examples/demo.py

# Every benchmark, side by side with torch.distributed (gloo / TCPStore) in one run, into
# one report: benchmarks/results/report.md (+ report.json and bus-bandwidth PNGs).
# The plots need matplotlib: the `bench` extra, installed here only (not for `make test`).
BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,docs,bench]'
	touch $(BENCH_STAMP)

bench: install $(BENCH_STAMP)
	$(PY) -m benchmarks.report

bench-quick: install $(BENCH_STAMP)
	$(PY) -m benchmarks.report --quick

# The whole fault matrix (tests/helpers/matrix.py): {p2p, collectives, store, elastic, rpc}
# x {kill -9 a rank, SIGSTOP a rank, kill -9 the daemon and restart it, a rank dying while
# the daemon is away, a newcomer} x shared memory on and off, in real processes, one cell
# after the other (about 15 minutes). The table: benchmarks/results/soak.md (+ soak.json,
# each cell's logs in benchmarks/results/soak/). make test runs a selection of cells.
SOAK_ARGS ?=

soak: install
	$(PY) -m tests.soak $(SOAK_ARGS)

# The GPU path on a real GPU (issue 36), in one run: pytest -m gpu, the overlap example,
# bus bandwidth and loop lag on CUDA tensors; summary into $OUT (or benchmarks/results/gpu/).
# No install step and no .venv: the system python's torch and packages run the checkout,
# as on a GPU machine that reaches no package registry. Without CUDA it fails at once.
GPU_CHECK_ARGS ?=

gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(SITE) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
