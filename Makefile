# stage_e_slots: `make demo` and `make test` work on a fresh Debian machine with nothing done first.
PG_CONFIG ?= /usr/lib/postgresql/15/bin/pg_config
PG_MAJOR  := $(shell $(PG_CONFIG) --version 2>/dev/null | sed -E 's/[^0-9]*([0-9]+).*/\1/')
PG_FEATURE = pg$(or $(PG_MAJOR),15)
PGDATA_TEST ?= /tmp/stage_e_slots_pgrx
# Root installs straight into the system Postgres; anyone else goes through sudo.
SUDO_FLAG := $(if $(filter 0,$(shell id -u)),,--sudo)

export PG_CONFIG

.PHONY: deps install install-dev demo demo-django bench test test-unit test-pg test-integration lint clean

deps:
	@scripts/install-deps.sh

## Release build into the Postgres that PG_CONFIG names (Debian's 15 by default).
install: deps
	cargo pgrx install --release $(SUDO_FLAG) --pg-config $(PG_CONFIG)

install-dev: deps
	cargo pgrx install $(SUDO_FLAG) --pg-config $(PG_CONFIG)

## A throwaway cluster showing the cap at work; stops it again.
demo: install
	.venv/bin/python scripts/demo.py

## Everything: slot-search unit tests, in-server tests, multi-session tests on real clusters.
test: deps test-unit test-pg test-integration

# Plain Rust, no server: the slot search (occupancy bitmap) and the counter arithmetic and file.
test-unit:
	PGRX_PG_CONFIG_PATH=$(PG_CONFIG) cargo test --features $(PG_FEATURE) --lib unit::

# #[pg_test]s, one at a time: they share one server and its slots.
test-pg:
	RUST_TEST_THREADS=1 cargo pgrx test $(PG_FEATURE) --runas postgres --pgdata $(PGDATA_TEST)

test-integration: install-dev
	.venv/bin/python -m pytest tests -v -s -p no:cacheprovider

lint: deps
	cargo fmt --check
	PGRX_PG_CONFIG_PATH=$(PG_CONFIG) cargo clippy --features $(PG_FEATURE) --all-targets -- -D warnings

clean:
	cargo clean
	rm -rf .venv /tmp/stage_e_slots $(PGDATA_TEST)

## The incident replayed with Django + django-q2, then fixed with the dedicated-connection helper.
demo-django: install
	.venv/bin/python scripts/demo_django.py

## Throughput against the peers in bench/ (about 5 minutes); writes bench/results/.
bench: install
	.venv/bin/python bench/run.py
