#!/usr/bin/env bash
# Installs what building, testing and demonstrating stage_e_slots needs, skipping what is there:
# Debian packages (PostgreSQL 15 and its headers, clang for bindgen, sudo for pgrx's --runas),
# cargo-pgrx 0.18.1, `cargo pgrx init` against the Debian PostgreSQL, and a Python venv with
# psycopg and pytest. As a non-root user it only lists what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGRX_VERSION=0.18.1
PACKAGES=(postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo python3-venv)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv is only needed when this python3 cannot make a venv by itself.
if python3 -c 'import venv, ensurepip' 2>/dev/null; then
  missing=("${missing[@]/python3-venv}")
fi
read -r -a missing <<<"${missing[*]}"

if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "stage_e_slots needs these Debian packages, which are not installed:" >&2
    echo "  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "==> apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION"; then
  echo "==> cargo install cargo-pgrx $PGRX_VERSION (about 7 minutes)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked --quiet
fi

if ! grep -qs "pg15 = \"$PG_CONFIG\"" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
  echo "==> cargo pgrx init --pg15 $PG_CONFIG"
  cargo pgrx init --pg15 "$PG_CONFIG" >/dev/null
fi

if [ ! -x .venv/bin/pytest ] || ! .venv/bin/python -c 'import psycopg, pytest, matplotlib, django, django_q' 2>/dev/null; then
  echo "==> python venv (.venv) with psycopg, pytest, matplotlib, Django and django-q2"
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
fi
