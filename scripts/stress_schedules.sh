#!/usr/bin/env bash
# Run every pipeline schedule N times (default 20) at pp=2 and report any run that failed, with its stderr.
# Meant to run beside another heavy job (e.g. the test suite) to shake out races under load:
#   bash scripts/stress_schedules.sh 20
set -u
n=${1:-20}
py=${PYTHON:-.venv/bin/python}
out=$(mktemp -d)
failed=0
for schedule in gpipe 1f1b interleaved zb; do
  extra=()
  [ "$schedule" = interleaved ] && extra=(--model tiny-deep --virtual-stages 2)
  ok=0
  for i in $(seq 1 "$n"); do
    if "$py" -m trainmesh train --nproc 2 --pp 2 --schedule "$schedule" --microbatches 4 --global-batch 8 \
        --steps 3 --no-progress --out "$out/$schedule-$i" "${extra[@]}" >/dev/null 2>"$out/$schedule-$i.err"; then
      ok=$((ok + 1))
    else
      failed=$((failed + 1))
      echo "--- $schedule run $i failed:"; tail -n 30 "$out/$schedule-$i.err"
    fi
  done
  echo "$schedule: $ok of $n runs passed"
done
rm -rf "$out"
exit $((failed > 0))
