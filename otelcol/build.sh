#!/usr/bin/env bash
# Builds the collector distribution of otelcol/manifest.yaml with ocb, unless the binary for this
# version of the manifest is already there (see otelcol/path.sh); prints the binary's path.
# Needs Go (the version the manifest's modules ask for, 1.26 here) and the Go module proxy.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
binary="$("$here/path.sh")"
if [ ! -x "$binary" ]; then
  # Go's standard install location, for shells whose PATH was set up by a login file only
  command -v go >/dev/null || [ ! -x /usr/local/go/bin/go ] || PATH="/usr/local/go/bin:$PATH"
  command -v go >/dev/null || { echo "otelcol/build.sh: Go is not installed (https://go.dev/doc/install)" >&2; exit 1; }
  builder="$(sed -n 's/^# builder: //p' "$here/manifest.yaml")"
  mkdir -p "$(dirname "$binary")"
  work="$(mktemp -d "$(dirname "$binary")/build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  echo "building $(basename "$binary") from otelcol/manifest.yaml (first time only; a few minutes)" >&2
  GOBIN="$work/bin" go install "$builder"
  cp "$here/manifest.yaml" "$work/manifest.yaml"  # its output_path (./dist) is relative to $work
  (cd "$work" && ./bin/builder --config manifest.yaml >&2)
  mv "$work/dist/otelcol-agenteval" "$binary"
fi
echo "$binary"
