#!/usr/bin/env bash
# Download the competitor wheels of issue 6 (benchmark-only dependencies, never required by
# fusedopt) into benchmarks/wheels/, for the GPU machine (Python 3.12, x86_64 Linux, no network).
# Versions are pinned in benchmarks/wheels.txt; `bash benchmarks/fetch_wheels.sh` checks sha256.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
mkdir -p wheels
grep -v '^#' wheels.txt | while read -r spec file _size sha; do
  [ -n "$spec" ] || continue
  if [ ! -f "wheels/$file" ]; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform any \
      -d wheels "$spec"
  fi
  echo "$sha  wheels/$file" | sha256sum -c --quiet - && echo "ok $file"
done
du -ch wheels/*.whl | tail -1
