#!/usr/bin/env bash
# Download the pinned SWE task sources (configs/data/swe_sources.txt) into DIR, sha256-checked by pip:
#   scripts/swe_sources.sh DIR [PYTHON]
# then: python launch/swe_build.py --sources=DIR --out=TASKS. Run once per machine; tests never download.
set -euo pipefail
dir=${1:?usage: scripts/swe_sources.sh DIR [PYTHON]}
py=${2:-python}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dir"
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
grep -v '^\s*#' "$here/configs/data/swe_sources.txt" | grep -v '^\s*$' | while read -r line; do
  echo "$line" > "$tmp"
  # --no-binary: the sdist (it ships the tests); --require-hashes: a tarball that differs is refused
  "$py" -m pip download --no-deps --no-binary :all: --require-hashes -q -d "$dir" -r "$tmp"
done
ls -1 "$dir"
