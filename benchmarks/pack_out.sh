#!/usr/bin/env bash
# pack_out.sh DIR: replace DIR's contents by one archive, DIR/results.tgz, because the GPU machine's
# device tool returns at most 8 files from $OUT (a call that wrote more lost its JSON on
# 2026-11-30; the console output comes back anyway). Unpack with: tar xzf DIR/results.tgz
set -uo pipefail
dir=${1:?usage: pack_out.sh DIR}
tmp=$(mktemp /tmp/results.XXXXXX.tgz)
tar czf "$tmp" -C "$dir" . || exit 1
find "$dir" -mindepth 1 -delete
mv "$tmp" "$dir/results.tgz"
echo "results of $dir: $dir/results.tgz"
