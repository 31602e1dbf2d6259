#!/usr/bin/env bash
# Prints the path of a source tree of commit BASE with its own .venv (the collector as that commit
# installs it with `make install`, its compiled decoder included), built once into
# ~/.cache/agenteval/bench-base/<full commit id>/ and reused: `make bench-check BASE=...` runs it
# beside this tree (bench/peers.py and bench/throughput.py --code use a tree's own .venv).
set -euo pipefail
base="${1:?usage: bench/base.sh COMMIT}"
sha="$(git rev-parse --verify "$base^{commit}")"
dir="${XDG_CACHE_HOME:-$HOME/.cache}/agenteval/bench-base/$sha"
if [ ! -e "$dir/.venv/bin/.bench-base" ]; then
  rm -rf "$dir"
  mkdir -p "$dir"
  git archive "$sha" | tar -x -C "$dir"
  echo "bench/base.sh: building $base ($sha) into $dir (first time only)" >&2
  make -C "$dir" install >&2
  touch "$dir/.venv/bin/.bench-base"
fi
echo "$dir"
