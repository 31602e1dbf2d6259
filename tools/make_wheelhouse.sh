#!/usr/bin/env bash
# Builds the wheelhouse a machine without a Python package index installs from (tools/offline.sh,
# docs/running.md "Offline / air-gapped install"), on a machine where PyPI, crates.io and Rust are:
#   tools/make_wheelhouse.sh [--dry-run] [DIR]          (make wheelhouse [WHEELHOUSE=DIR])
# DIR is by default where tools/offline.sh looks: $AGENTEVAL_WHEELHOUSE, else ../shared/wheelhouse-pyXY
# beside the repository, XY being PYTHON's version (python3.11 unless PYTHON says otherwise; the wheels
# are for that Python on this platform). Into it go the wheels of everything pip installs for:
#   - each MAF release of the Makefile's MAF_DEFAULT and MAF_MATRIX: the instrumentation and the
#     collector's `test` extra under that release's pins, as tools/maf-venv installs them (make install,
#     make test-maf-matrix), and what `opentelemetry-bootstrap -a install` adds to the zero-code test's
#     environment (tools/zero-code-venv): the instrumentation of every library of that install it knows;
#   - the collector with every extra of pyproject.toml (bench's rotel, the Dockerfile's postgres, ...);
#   - pip, and the build backends pip builds the collector and the instrumentation with (their
#     [build-system] requires; native/'s maturin is left out: offline nothing can build the decoder);
# each install resolved as pip resolves it online (pip install --dry-run --report), then every wheel
# fetched, or built for a package published as source only. The collector and the instrumentation
# themselves are not in it: pip builds them from the checkout. And:
#   - native/<sum>/agenteval_native-*.whl: the compiled decoder native/build.sh builds from today's
#     native/ sources (<sum> is native/build.sh --sum), which offline only the wheelhouse can give.
# Re-runnable: what is there stays (so does the decoder of earlier native/ sources), pip's cache makes
# a second run cheap; it prints what it added. --dry-run prints what it would resolve and where.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: tools/make_wheelhouse.sh [--dry-run] [DIR]"
dry_run=""
[ "${1:-}" != --dry-run ] || { dry_run=1; shift; }
[ $# -le 1 ] && [ "${1:-}" != -h ] && [ "${1:-}" != --help ] || { echo "$usage" >&2; exit 2; }
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
instrumentation=instrumentation/opentelemetry-instrumentation-maf-fidelity
source tools/offline.sh
dir="$(realpath -m "${1:-$(agenteval_wheelhouse_path "$python")}")"
# core:orchestrations pairs, as make reads them (one list, the Makefile's)
releases="$(make -s --no-print-directory --eval 'maf-releases: ; @echo $(MAF_DEFAULT) $(MAF_MATRIX)' maf-releases)"
extras="$("$python" -c 'import tomllib; print(",".join(sorted(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"])))')"
mapfile -t build_requires < <("$python" - "$instrumentation/pyproject.toml" <<'PY'
import sys, tomllib
for name in dict.fromkeys(r for path in ("pyproject.toml", *sys.argv[1:])
                          for r in tomllib.load(open(path, "rb"))["build-system"]["requires"]):
    print(name)
PY
)
sum="$(native/build.sh --sum)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
touch "$work/left-out.txt"

# resolve NAME ARGS...: what `pip install ARGS` installs into an empty environment, as NAME.pins
# (name==version a line; the checkout's own packages left out); pip's report is NAME.json. With
# --dry-run, prints the pip command instead (a constraint file's lines in <>).
resolve() {
  local name="$1" arg prev="" shown=""
  shift
  if [ -n "$dry_run" ]; then
    for arg in "$@"; do
      if [ "$prev" = -c ]; then shown+=" <$(paste -sd' ' "$arg")>"; else shown+=" $arg"; fi
      prev="$arg"
    done
    echo "  $name: pip install${shown}"
    return
  fi
  "$pip" install --quiet --dry-run --ignore-installed --report "$work/$name.json" "$@" || return 1
  "$work/venv/bin/python" - "$work/$name.json" >"$work/$name.pins" <<'PY'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    if "dir_info" not in item["download_info"]:
        print(f"{item['metadata']['name']}=={item['metadata']['version']}")
PY
}

# bootstrap_adds PINS: what opentelemetry-bootstrap (at PINS's release of opentelemetry-instrumentation)
# installs into an environment holding any of PINS: its default instrumentations and the one of every
# library it knows at a version it supports, as its _find_installed_libraries decides.
bootstrap_adds() {
  "$pip" install --quiet "$(grep -i '^opentelemetry-instrumentation==' "$1")"
  "$work/venv/bin/python" - "$1" <<'PY'
import sys
from opentelemetry.instrumentation.bootstrap_gen import default_instrumentations, libraries
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
pins = dict(line.strip().split("==") for line in open(sys.argv[1]))
have = {canonicalize_name(name): version for name, version in pins.items()}
print(*default_instrumentations, sep="\n")
for lib in libraries:
    want = Requirement(lib["library"])
    version = have.get(canonicalize_name(want.name))
    if version is not None and list(want.specifier.filter([version])):
        print(lib["instrumentation"])
PY
}

if [ -n "$dry_run" ]; then
  echo "wheelhouse $dir, for $python (--dry-run: nothing fetched or built)"
  echo "  native: native/build.sh's compiled decoder, into $dir/native/$sum/"
else
  [ -z "${PIP_NO_INDEX:-}" ] && agenteval_index_reachable "$python" || {
    echo "tools/make_wheelhouse.sh: pip reaches no package index here: build the wheelhouse where one answers" >&2
    exit 1
  }
  "$python" -m venv "$work/venv"
  pip="$work/venv/bin/pip"
  "$pip" install --quiet --upgrade pip packaging
  # The decoder first: without Rust, this stops before the minutes of downloads.
  native="$(native/build.sh "$work/venv/bin/python")"
  mkdir -p "$dir/native/$sum"
  before="$(cd "$dir" && find . -type f | sort)"
  [ -e "$dir/native/$sum/$(basename "$native")" ] || cp "$native" "$dir/native/$sum/"
fi

for release in $releases; do
  core="${release%%:*}" orch="${release##*:}"
  echo "resolving MAF $core + orchestrations $orch: the instrumentation, .[test], the zero-code environment"
  printf 'agent-framework-core==%s\nagent-framework-orchestrations==%s\n' "$core" "$orch" >"$work/maf-$release.txt"
  resolve "maf-$release" -c "$work/maf-$release.txt" "./$instrumentation" ".[test]"
  if [ -n "$dry_run" ]; then
    echo "  maf-$release-bootstrap: pip install -c <maf-$release's pins> <each alone, of what opentelemetry-bootstrap adds to them>"
    continue
  fi
  # bootstrap installs them one at a time and goes on past one pip cannot install (one its release
  # names that was never published, say). Here: all at once (but those an earlier release could not
  # have), and if pip cannot, one at a time, leaving out (and saying at the end) the ones it cannot.
  mapfile -t adds < <(bootstrap_adds "$work/maf-$release.pins" | grep -vxF -f "$work/left-out.txt" || true)
  [ ${#adds[@]} -eq 0 ] || resolve "maf-$release-bootstrap" -c "$work/maf-$release.pins" "${adds[@]}" 2>/dev/null ||
    for add in "${adds[@]}"; do
      resolve "maf-$release-bootstrap-${add%%[=<>~!]*}" -c "$work/maf-$release.pins" "$add" 2>"$work/pip.err" ||
        { echo "$add" >>"$work/left-out.txt"; tail -n 1 "$work/pip.err" >>"$work/left-out.log"; }
    done
done
echo "resolving the collector with every extra, pip and the build backends"
resolve extras ".[$extras]"
resolve build pip "${build_requires[@]}"
[ -z "$dry_run" ] || exit 0

# One pip call per layer: pip takes one version of a name per call, the releases pin several.
"$work/venv/bin/python" - "$work" <<'PY'
import collections, pathlib, sys
work = pathlib.Path(sys.argv[1])
versions = collections.defaultdict(set)
for pins in work.glob("*.pins"):
    for line in pins.read_text().split():
        name, version = line.split("==")
        versions[name.lower()].add(version)
for layer in range(max(map(len, versions.values()))):
    (work / f"layer-{layer}.txt").write_text("".join(
        f"{name}=={sorted(found)[layer]}\n" for name, found in sorted(versions.items()) if layer < len(found)))
PY
echo "fetching $(cat "$work"/layer-*.txt | wc -l) wheels into $dir"
for layer in "$work"/layer-*.txt; do
  "$pip" wheel --quiet --no-deps --wheel-dir "$dir" -r "$layer"
done

added="$(comm -13 <(echo "$before") <(cd "$dir" && find . -type f | sort) | sed 's|^\./|  |')"
echo "wheelhouse $dir: $(find "$dir" -type f | wc -l) files, $(du -sh "$dir" | cut -f1)," \
  "the compiled decoder for today's native/ in native/$sum/"
[ ! -s "$work/left-out.log" ] || { echo "left out, as opentelemetry-bootstrap cannot install them either:"
  sed 's/^/  /' "$work/left-out.log"; }
if [ -n "$added" ]; then echo "added:"; echo "$added"; else echo "added: nothing (it held all of it)"; fi
