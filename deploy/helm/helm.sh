#!/usr/bin/env bash
# Builds helm (the version pinned below) from the Go module proxy, unless it is already in
# ~/.cache/agenteval/helm/<version>/; prints its path. `path` instead prints where it goes without
# building (the tests look there). Needs Go (https://go.dev/doc/install).
set -euo pipefail
# The helm release the chart is rendered with (tests/test_deploy.py): a v3 the Go proxy serves.
module="helm.sh/helm/v3/cmd/helm@v3.22.0"
binary="${XDG_CACHE_HOME:-$HOME/.cache}/agenteval/helm/${module##*@}/helm"
if [ "${1:-}" = path ]; then echo "$binary"; exit 0; fi
if [ ! -x "$binary" ]; then
  # Go's standard install location, for shells whose PATH was set up by a login file only
  command -v go >/dev/null || [ ! -x /usr/local/go/bin/go ] || PATH="/usr/local/go/bin:$PATH"
  command -v go >/dev/null || { echo "deploy/helm/helm.sh: Go is not installed (https://go.dev/doc/install)" >&2; exit 1; }
  mkdir -p "$(dirname "$binary")"
  work="$(mktemp -d "$(dirname "$binary")/build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  echo "building helm ${module##*@} from the Go module proxy (first time only; a few minutes)" >&2
  GOBIN="$work" go install "$module" >&2
  mv "$work/helm" "$binary"
fi
echo "$binary"
