#!/usr/bin/env bash
# Runs each argument as one phase (a command line, run by bash), stopping at the first that
# fails, and prints at the end how long each phase took, so that a newcomer knows what a long
# run spent its time on (and, after a failure, which phase failed and after how long).
# `make test` and .ci/run use it. Usage: phases.sh TITLE 'COMMAND' ['COMMAND' ...]
set -uo pipefail
title=$1
shift
names=()
secs=()
status=0
all_start=$SECONDS
for phase in "$@"; do
  start=$SECONDS
  bash -c "$phase"
  status=$?
  names+=("$phase")
  secs+=($((SECONDS - start)))
  ((status == 0)) || break
done
echo
echo "==> $title: time per phase"
for i in "${!names[@]}"; do
  printf '  %4dm%02ds  %s\n' $((secs[i] / 60)) $((secs[i] % 60)) "${names[i]}"
done
total=$((SECONDS - all_start))
if ((status == 0)); then
  printf '  %4dm%02ds  total: every phase passed\n' $((total / 60)) $((total % 60))
else
  printf '  %4dm%02ds  total: FAILED in the last phase above (exit %d); later phases not run\n' \
    $((total / 60)) $((total % 60)) "$status"
fi
exit "$status"
