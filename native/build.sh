#!/usr/bin/env bash
# Builds the compiled decoder (agenteval_native) into a wheel for PYTHON, unless the wheel for this
# version of native/ (Cargo.toml, Cargo.lock, pyproject.toml, src/) is already in
# ~/.cache/agenteval/native/<sha256>/; prints the wheel's path. Needs Rust (cargo) and PyPI (maturin).
#   native/build.sh --sum   prints only that sha256, the name of this version of native/ (a wheelhouse
#                           files the decoder under it too: tools/offline.sh, tools/make_wheelhouse.sh)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
sum="$(cd "$here" && sha256sum Cargo.toml Cargo.lock pyproject.toml $(find src -type f | LC_ALL=C sort) | sha256sum | cut -d' ' -f1)"
[ "${1:-}" != --sum ] || { echo "$sum"; exit 0; }
python="${1:?usage: native/build.sh PYTHON | native/build.sh --sum}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/agenteval/native"
tag="$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
find_wheel() { compgen -G "$cache/$sum/agenteval_native-*-$tag-*.whl" | head -n 1; }
if [ -z "$(find_wheel)" ]; then
  # rustup's install location, for shells whose PATH was set up by a login file only
  command -v cargo >/dev/null || [ ! -x "$HOME/.cargo/bin/cargo" ] || PATH="$HOME/.cargo/bin:$PATH"
  command -v cargo >/dev/null || { echo "native/build.sh: Rust is not installed (https://rustup.rs)" >&2; exit 1; }
  mkdir -p "$cache/$sum"
  work="$(mktemp -d "$cache/$sum/build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  echo "building the native decoder from native/ (first time only; about 30 s)" >&2
  # One cargo target directory for every version, so a change to native/ rebuilds incrementally.
  CARGO_TARGET_DIR="$cache/target" "$python" -m pip wheel --quiet --no-deps --wheel-dir "$work" "$here" >&2
  mv "$work"/agenteval_native-*.whl "$cache/$sum/"
fi
find_wheel
