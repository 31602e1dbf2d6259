# Sourced by tools/maf-venv and .ci/run (bash): installing where no Python package index answers.
# docs/running.md "Offline / air-gapped install" says the same for a user.
#
#   agenteval_offline PYTHON   when pip cannot reach its package index and a wheelhouse is there,
#                              exports PIP_NO_INDEX=1 and adds the wheelhouse to PIP_FIND_LINKS (so
#                              every pip below, the tests' own venvs included, installs from it) and
#                              AGENTEVAL_WHEELHOUSE; prints one line saying so. Online it changes
#                              nothing: the polyglot path stays exactly as it was.
#   agenteval_build_or_skip WHAT REQUIRE REGISTRY COMMAND...
#                              (.ci/run) runs COMMAND, which builds a part of the tests from a
#                              registry. Online (no PIP_NO_INDEX) plainly: its failure fails. Offline,
#                              when it failed without reaching its registry (a tool missing, a host
#                              not resolved, a connection refused, Maven finding no plugin: with -q
#                              that is all it says of an unreachable repository), unsets the variable REQUIRE and
#                              adds "WHAT: not run, ..." to the array `skipped`; any other failure fails.
#   agenteval_native_wheel PYTHON
#                              prints the wheelhouse's prebuilt compiled decoder for today's native/
#                              sources (native/<sha256>/, the sum native/build.sh --sum prints), or
#                              nothing when none matches.
#   agenteval_wheelhouse_path PYTHON
#                              prints where the wheelhouse for PYTHON is looked for, there or not.
#
# The wheelhouse is $AGENTEVAL_WHEELHOUSE, else ../shared/wheelhouse-pyXY beside the repository;
# tools/make_wheelhouse.sh (make wheelhouse) builds it where a package index answers.

agenteval_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

agenteval_index_reachable() {
  "$1" -m pip index versions pip --retries 0 --timeout 10 --no-input >/dev/null 2>&1
}

agenteval_wheelhouse_path() {
  local tag
  tag="$("$1" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')"
  echo "${AGENTEVAL_WHEELHOUSE:-$agenteval_root/../shared/wheelhouse-$tag}"
}

agenteval_wheelhouse() {
  local dir
  dir="$(agenteval_wheelhouse_path "$1")"
  [ -d "$dir" ] && (cd "$dir" && pwd)
}

agenteval_offline() {
  local python="$1" wheelhouse
  [ -z "${PIP_NO_INDEX:-}" ] || return 0  # already offline (an outer script, or the user)
  agenteval_index_reachable "$python" && return 0
  if ! wheelhouse="$(agenteval_wheelhouse "$python")"; then
    echo "note: pip reaches no package index and there is no wheelhouse (set AGENTEVAL_WHEELHOUSE): the install will fail" >&2
    return 0
  fi
  export PIP_NO_INDEX=1 AGENTEVAL_WHEELHOUSE="$wheelhouse"
  export PIP_FIND_LINKS="$wheelhouse${PIP_FIND_LINKS:+ $PIP_FIND_LINKS}"
  echo "note: pip reaches no package index: installing from the wheelhouse $wheelhouse" >&2
}

agenteval_native_wheel() {
  local python="$1" wheelhouse sum tag
  wheelhouse="$(agenteval_wheelhouse "$python")" || return 0
  sum="$("$agenteval_root/native/build.sh" --sum)"
  tag="$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
  compgen -G "$wheelhouse/native/$sum/agenteval_native-*-$tag-*.whl" | head -n 1 || true
}

agenteval_build_or_skip() {
  local what="$1" require="$2" registry="$3" out
  shift 3
  if [ -z "${PIP_NO_INDEX:-}" ]; then
    "$@"
    return
  fi
  if out=$("$@" 2>&1); then
    [ -z "$out" ] || echo "$out"
    return 0
  fi
  echo "$out" | tail -n 3
  if grep -qiE "not installed|no such host|could not resolve|unknownhost|unknown host|network is unreachable|connection refused|dial tcp|could not transfer artifact|no plugin found for prefix|temporary failure in name resolution|getaddrinfo|econnrefused" <<<"$out"; then
    skipped+=("$what: not run, it needs $registry, which this machine lacks or cannot reach")
    unset "$require"
    return 0
  fi
  return 1
}
