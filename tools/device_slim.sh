#!/bin/bash
# Development aid: keep the device tool's copy of the working tree under its 64 MiB (tracked files + carry).
# The committed allocation traces (benchmarks/accuracy/traces*) are CPU-test data that no GPU command reads; this
# moves them out of the checkout before a `run` call and back after it.
#   bash tools/device_slim.sh hide      # before the run call
#   bash tools/device_slim.sh restore   # right after it, before any commit (git status must show no deletion)
set -eu
cd "$(git rev-parse --show-toplevel)"
hold=../.device-hold/$(basename "$PWD")
case "${1:-}" in
  hide)
    mkdir -p "$hold"
    for d in benchmarks/accuracy/traces*/; do
      [ -d "$d" ] && mv "$d" "$hold/"
    done
    git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | sed 's/total/KiB of tracked files left/';;
  restore)
    [ -d "$hold" ] || { echo "nothing held in $hold"; exit 0; }
    for d in "$hold"/traces*; do
      [ -e "$d" ] && mv "$d" benchmarks/accuracy/
    done
    rmdir "$hold" 2>/dev/null || true
    git status --short | grep '^ D' && { echo "still missing: see above"; exit 1; } || echo "restored";;
  *) echo "usage: bash tools/device_slim.sh hide|restore" >&2; exit 2;;
esac
