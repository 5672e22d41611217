#!/usr/bin/env bash
# Installs what building, testing and demonstrating stage_e_slots needs, skipping what is there:
# Debian packages (PostgreSQL 15 and its headers, clang for bindgen, sudo for pgrx's --runas,
# pgbouncer for the pooler tests, gdb to pause a worker in one lease test, redis-server as the
# Celery broker of tests/python/test_task_queues.py, faketime (libfaketime) to step a server's
# wall clock in tests/test_rate_clock.py), cargo-pgrx 0.18.1, `cargo pgrx init` for the PostgreSQL major
# in use, and a Python venv with psycopg, pytest, pytest-timeout, matplotlib, Django, django-q2, and
# build, mypy, django-stubs and ruff for the Python package (python/). Where the
# driver matrix runs (tests/test_drivers.py: PostgreSQL 15, or STAGE_E_DRIVER_TESTS=1), also the
# drivers: Debian's ruby-pg, Go with pgx v4 (Debian's packaged Go modules: the Go module proxy
# is not used), a JDK and the PostgreSQL JDBC driver, npm when there is none, node-postgres
# from npm into tests/drivers/node, and asyncpg and psycopg2 in the venv. Where the Patroni
# failover test runs (tests/test_patroni.py: PostgreSQL 15, or STAGE_E_PATRONI_TESTS=1), also
# Debian's patroni and etcd-server, with the services they enable disabled (the test starts its
# own etcd and Patroni on other ports). For the monitoring files (monitoring/, `make
# test-monitoring`, tests/test_monitoring.py): Debian's prometheus-postgres-exporter and
# prometheus (promtool comes with it), installed without their recommends (node-exporter and
# its collectors), with the services they enable disabled and stopped (the tests start their
# own on free loopback ports). As a non-root user it only lists what is missing.
# Usage: install-deps.sh [MAJOR [PG_CONFIG]]
set -euo pipefail
cd "$(dirname "$0")/.."

MAJOR=${1:-15}
PG15_CONFIG=/usr/lib/postgresql/15/bin/pg_config
PG_CONFIG=${2:-$PG15_CONFIG}
PGRX_VERSION=0.18.1
PACKAGES=(postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo python3-venv pgbouncer gdb
          redis-server faketime)
# The driver matrix runs on one major (the CI time budget): 15, unless STAGE_E_DRIVER_TESTS=1.
DRIVERS=0
if [ "$MAJOR" = 15 ] || [ "${STAGE_E_DRIVER_TESTS:-}" = 1 ]; then
  DRIVERS=1
  PACKAGES+=(ruby-pg golang-go golang-github-jackc-pgx-v4-dev default-jdk-headless
             libpostgresql-jdbc-java npm)
fi
# So does the Patroni failover test, unless STAGE_E_PATRONI_TESTS=1.
PATRONI=0
if [ "$MAJOR" = 15 ] || [ "${STAGE_E_PATRONI_TESTS:-}" = 1 ]; then
  PATRONI=1
  PACKAGES+=(patroni etcd-server)
fi
# Installed with --no-install-recommends: the recommends pull in prometheus-node-exporter and
# its collectors (smartmontools, ipmitool, nvme-cli and more), 38 packages instead of 13.
MONITORING=(prometheus-postgres-exporter prometheus)

installed() {
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}
missing=()
for p in "${PACKAGES[@]}"; do
  installed "$p" || missing+=("$p")
done
missing_monitoring=()
for p in "${MONITORING[@]}"; do
  installed "$p" || missing_monitoring+=("$p")
done
# python3-venv is only needed when this python3 cannot make a venv by itself.
if python3 -c 'import venv, ensurepip' 2>/dev/null; then
  missing=("${missing[@]/python3-venv}")
fi
# npm only when there is none (a Node.js from elsewhere brings its own and conflicts with it).
if command -v npm >/dev/null 2>&1; then
  missing=("${missing[@]/npm}")
fi
read -r -a missing <<<"${missing[*]}"

if ((${#missing[@]} + ${#missing_monitoring[@]})) && [ "$(id -u)" -ne 0 ]; then
  echo "stage_e_slots needs these Debian packages, which are not installed:" >&2
  ((${#missing[@]})) && echo "  sudo apt-get install -y ${missing[*]}" >&2
  ((${#missing_monitoring[@]})) &&
    echo "  sudo apt-get install -y --no-install-recommends ${missing_monitoring[*]}" >&2
  exit 1
fi
if ((${#missing[@]} + ${#missing_monitoring[@]})); then
  apt-get update -qq
fi
if ((${#missing_monitoring[@]})); then
  echo "==> apt-get install --no-install-recommends ${missing_monitoring[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing_monitoring[@]}" >/dev/null
fi
if ((${#missing[@]})); then
  echo "==> apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  if [[ " ${missing[*]} " == *" redis-server "* ]]; then
    # Likewise Debian's redis-server service (port 6379): the Celery test starts its own.
    echo "==> stopping and disabling the redis-server service the package started"
    systemctl disable redis-server >/dev/null 2>&1 || true
    update-rc.d redis-server disable >/dev/null 2>&1 || true
    service redis-server stop >/dev/null 2>&1 || true
  fi
  if [[ " ${missing[*]} " == *" pgbouncer "* ]]; then
    # Debian's package starts a system pgbouncer on port 6432 and enables it at boot; the tests
    # start their own (scripts/pgbouncer.py), so stop and disable the one we just installed.
    echo "==> stopping and disabling the pgbouncer service the package started"
    systemctl disable pgbouncer >/dev/null 2>&1 || true
    update-rc.d pgbouncer disable >/dev/null 2>&1 || true
    service pgbouncer stop >/dev/null 2>&1 || true
  fi
fi

# The packages enable Debian's etcd (2379/2380) and patroni services at boot, and their postinst
# starts them wherever policy-rc.d allows it; scripts/hacluster.py starts its own, so disable
# both and stop whatever of them runs. Checked on every run (cheap, and an install interrupted
# before this point still gets it), and silent when there is nothing to do.
if [ "$PATRONI" = 1 ] && [ "$(id -u)" -eq 0 ] && [ -e /etc/init.d/etcd ]; then
  for svc in etcd patroni; do
    if compgen -G "/etc/rc[2-5].d/S*$svc" >/dev/null; then
      echo "==> disabling the $svc service the package enabled"
      update-rc.d "$svc" disable >/dev/null 2>&1 || true
    fi
    if [ -d /run/systemd/system ] && systemctl -q is-enabled "$svc" 2>/dev/null; then
      systemctl disable --now "$svc" >/dev/null 2>&1 || true
    fi
    if "/etc/init.d/$svc" status >/dev/null 2>&1; then
      echo "==> stopping the $svc service"
      "/etc/init.d/$svc" stop >/dev/null 2>&1 || true
    fi
  done
  # Debian's default etcd listens on 2379; ours never does (hacluster.py uses 571xx).
  for pid in $(ss -Hltnp 'sport = :2379' 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = etcd ]; then
      echo "==> stopping the default etcd (pid $pid) on port 2379"
      kill "$pid" 2>/dev/null || true
    fi
  done
fi

# The same for Debian's prometheus (9090) and prometheus-postgres-exporter (9187): their postinst
# enables both services (systemd units and SysV links) and starts them where policy-rc.d allows
# it; tests/test_monitoring.py starts its own, so disable both and stop whatever of them runs.
# `systemctl disable` also works without a running systemd (it removes the unit symlinks and
# the SysV links). Checked on every run, and silent when there is nothing to do.
if [ "$(id -u)" -eq 0 ]; then
  for svc in prometheus prometheus-postgres-exporter; do
    [ -e "/etc/init.d/$svc" ] || continue
    if compgen -G "/etc/rc[2-5].d/S[0-9][0-9]$svc" >/dev/null ||
       [ -e "/etc/systemd/system/multi-user.target.wants/$svc.service" ]; then
      echo "==> disabling the $svc service the package enabled"
      systemctl disable "$svc.service" >/dev/null 2>&1 || update-rc.d "$svc" disable >/dev/null 2>&1 || true
    fi
    if [ -d /run/systemd/system ] && systemctl -q is-active "$svc" 2>/dev/null; then
      systemctl stop "$svc" >/dev/null 2>&1 || true
    fi
    if "/etc/init.d/$svc" status >/dev/null 2>&1; then
      echo "==> stopping the $svc service"
      "/etc/init.d/$svc" stop >/dev/null 2>&1 || true
    fi
  done
fi

if ! cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION"; then
  echo "==> cargo install cargo-pgrx $PGRX_VERSION (about 7 minutes)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked --quiet
fi

# pgrx needs every major it builds for in its config.toml; init rewrites the file, so name
# Debian's 15 and the one asked for.
config="${PGRX_HOME:-$HOME/.pgrx}/config.toml"
if ! grep -qs "pg$MAJOR = \"$PG_CONFIG\"" "$config"; then
  args=(--pg15 "$PG15_CONFIG")
  [ "$MAJOR" != 15 ] && args+=("--pg$MAJOR" "$PG_CONFIG")
  echo "==> cargo pgrx init ${args[*]}"
  cargo pgrx init "${args[@]}" >/dev/null
fi

if [ ! -x .venv/bin/pytest ] || [ ! -x .venv/bin/ruff ] || ! .venv/bin/python -c 'import psycopg, pytest, pytest_timeout, matplotlib, django, django_q, asyncpg, psycopg2, build, mypy, django_stubs_ext, unasync' 2>/dev/null; then
  echo "==> python venv (.venv) with psycopg, pytest, pytest-timeout, matplotlib, Django, django-q2, asyncpg, psycopg2, and build, mypy, django-stubs, ruff and unasync for the Python package"
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
fi

# node-postgres, at the version tests/drivers/node/package-lock.json pins.
node_pg=tests/drivers/node/node_modules/pg/package.json
if [ "$DRIVERS" = 1 ] && ! grep -qs '"version": "8.23.1"' "$node_pg"; then
  echo "==> npm ci in tests/drivers/node (node-postgres)"
  (cd tests/drivers/node && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
