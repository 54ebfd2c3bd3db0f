#!/usr/bin/env bash
# The whole test suite, as `make test` runs it (after the host set-up and lint), in two phases:
#   1. the integration tests that keep to what they started, JOBS pytest-xdist workers, one test
#      file per worker (its module fixtures stay together), the longest files first
#      (tests/conftest.py's LONGEST_FIRST) so that the workers end together;
#   2. the `exclusive` integration tests (they count what the whole host holds: free hugepages,
#      domains, macvtaps, the cluster's ports) one after another, while the tests that start no
#      guest (unit, cli) run beside them on JOBS-1 workers; their output follows the exclusive run's.
# Arguments are passed to every pytest run (e.g. `-k sizing`). Exit status 5 of a run (nothing
# selected) is not a failure; any other non-zero one is. SIGINT/SIGTERM reach every run (each
# removes what it started) before this script ends.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
JOBS=${JOBS:-$(($(nproc) + 1))}
(( JOBS >= 2 )) || JOBS=2
status=0
ok() { [[ $1 -eq 0 || $1 -eq 5 ]] || status=1; }

echo "== phase 1: integration tests on $JOBS workers"
"$PY" -m pytest -n "$JOBS" --dist loadfile -m "integration and not exclusive" "$@"
ok $?

echo "== phase 2: exclusive integration tests one at a time, unit and cli tests on $((JOBS - 1)) workers beside them"
beside_log=$(mktemp /tmp/vmsandbox-test-beside.XXXXXX)
trap 'kill -TERM "$beside" 2>/dev/null; wait "$beside" 2>/dev/null; rm -f "$beside_log"' EXIT
"$PY" -m pytest -n "$((JOBS - 1))" -m "not integration" "$@" >"$beside_log" 2>&1 &
beside=$!
"$PY" -m pytest -m "exclusive" "$@"
ok $?
wait "$beside"
beside_rc=$?
echo "== phase 2: the unit and cli tests"
cat "$beside_log"
ok $beside_rc
exit $status
