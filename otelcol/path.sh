#!/bin/sh
# Prints where otelcol/build.sh puts the collector built from otelcol/manifest.yaml (the tests and
# bench look there too): one directory per manifest version under the user cache dir.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
sum=$(sha256sum "$here/manifest.yaml" | cut -d' ' -f1)
echo "${XDG_CACHE_HOME:-$HOME/.cache}/agenteval/otelcol/$sum/otelcol-agenteval"
