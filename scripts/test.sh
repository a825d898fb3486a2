#!/usr/bin/env bash
# Create or reuse .venv, install k2jax with its test extra, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q -e '.[test]'
exec python -m pytest -q tests "$@"
