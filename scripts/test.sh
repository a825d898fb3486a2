#!/usr/bin/env bash
# Create or reuse .venv, install k2jax with its test extra, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q -e '.[test]'
# Two workers, whole test files each (module fixtures compile once), handed out heaviest first
# (tests/conftest.py HEAVY_FIRST; --no-loadscope-reorder keeps that order instead of xdist's most-tests-first,
# which left the one-test multi-process files for last). On 2 cores: 24 min with other jobs running beside it,
# against 30 min serial on CI. PYTEST_WORKERS=0 runs serially.
# The whole run's wall time is printed last, pass or fail (the 20-minute budget on 2 cores is checked from it).
start=$(date +%s)
rc=0
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=30 tests "$@" || rc=$?
secs=$(( $(date +%s) - start ))
echo "suite_wall_time=${secs}s ($((secs / 60))m$((secs % 60))s) rc=${rc}"
exit "$rc"
