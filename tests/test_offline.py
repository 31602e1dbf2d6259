"""Installing where no Python package index answers (tools/offline.sh, tools/native-wheel; docs/running.md
"Offline / air-gapped install"): pip is sent to the wheelhouse only when its index cannot be reached, and
the compiled decoder comes from the wheelhouse's build for today's native/ sources, by native/build.sh's
own sum. tools/make_wheelhouse.sh (make wheelhouse) builds that wheelhouse: here only its plan
(--dry-run), since a real build downloads some 150 MB."""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
INSTRUMENTATION = "instrumentation/opentelemetry-instrumentation-maf-fidelity"


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "AGENTEVAL_WHEELHOUSE"))}
    return subprocess.run(["bash", "-c", f"source {ROOT}/tools/offline.sh; {script}"], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120)


@pytest.fixture()
def local_index(tmp_path: Path) -> Iterator[str]:
    """A package index on loopback (PEP 503) that lists pip: an index pip reaches."""
    (tmp_path / "index" / "pip").mkdir(parents=True)
    (tmp_path / "index" / "pip" / "index.html").write_text(
        '<a href="pip-24.0-py3-none-any.whl#sha256=' + "0" * 64 + '">pip-24.0-py3-none-any.whl</a>')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def _closed_port_url() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/simple/"


def test_without_an_index_pip_is_sent_to_the_wheelhouse_and_says_so(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    got = _bash('agenteval_offline "$PY"; echo "no_index=$PIP_NO_INDEX"; echo "links=$PIP_FIND_LINKS"',
                {"PY": sys.executable, "PIP_INDEX_URL": _closed_port_url(), "PIP_FIND_LINKS": "/opt/other wheels",
                 "AGENTEVAL_WHEELHOUSE": str(wheelhouse)})
    assert got.returncode == 0, got.stderr
    assert f"installing from the wheelhouse {wheelhouse}" in got.stderr
    assert "no_index=1" in got.stdout
    # the wheelhouse first, the machine's own find-links kept
    assert f"links={wheelhouse} /opt/other wheels" in got.stdout


def test_with_an_index_nothing_changes(local_index, tmp_path):
    got = _bash('agenteval_offline "$PY"; echo "no_index=${PIP_NO_INDEX:-}"; echo "links=${PIP_FIND_LINKS:-}"',
                {"PY": sys.executable, "PIP_INDEX_URL": local_index, "AGENTEVAL_WHEELHOUSE": str(tmp_path)})
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["no_index=", "links="] and got.stderr == ""


def test_without_an_index_or_a_wheelhouse_the_install_is_said_to_fail(tmp_path):
    got = _bash('agenteval_offline "$PY"; echo "no_index=${PIP_NO_INDEX:-}"',
                {"PY": sys.executable, "PIP_INDEX_URL": _closed_port_url(),
                 "AGENTEVAL_WHEELHOUSE": str(tmp_path / "none")})
    assert "there is no wheelhouse" in got.stderr and "no_index=" in got.stdout.split()


def _wheelhouse_plan(*args: str, env: dict[str, str] | None = None) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "AGENTEVAL_WHEELHOUSE"))}
    got = subprocess.run([str(ROOT / "tools/make_wheelhouse.sh"), "--dry-run", *args], capture_output=True,
                         text=True, env={**clean, "PYTHON": sys.executable, **(env or {})}, timeout=60)
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_the_wheelhouse_decoder_is_the_one_native_build_sh_would_cache(tmp_path):
    """offline.sh takes the sum of native/ from native/build.sh: a wheel filed under that sum, in
    build.sh's cache, is the one build.sh prints (with no Rust on PATH, it could build none); and
    make_wheelhouse.sh files it there, in the wheelhouse offline.sh looks in."""
    sum_dir = _bash('w=$(agenteval_native_wheel "$PY"); echo "$w"', {
        "PY": sys.executable, "AGENTEVAL_WHEELHOUSE": str(tmp_path / "wh")})
    assert sum_dir.stdout.strip() == ""  # nothing filed yet
    digest = _bash('cd native && sha256sum Cargo.toml Cargo.lock pyproject.toml $(find src -type f | LC_ALL=C sort) '
                   '| sha256sum | cut -d" " -f1', {}).stdout.strip()
    wheel = f"agenteval_native-0.1.0-{TAG}-{TAG}-linux_x86_64.whl"
    for folder in (tmp_path / "wh" / "native" / digest, tmp_path / "cache" / "agenteval" / "native" / digest):
        folder.mkdir(parents=True)
        (folder / wheel).write_bytes(b"")
    offline = subprocess.run([str(ROOT / "tools/native-wheel"), sys.executable], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1",
                                  "AGENTEVAL_WHEELHOUSE": str(tmp_path / "wh")})
    built = subprocess.run([str(ROOT / "native/build.sh"), sys.executable], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert offline.returncode == 0 and built.returncode == 0, (offline.stderr, built.stderr)
    assert Path(offline.stdout.strip()).name == Path(built.stdout.strip()).name == wheel
    assert Path(offline.stdout.strip()).parent.name == Path(built.stdout.strip()).parent.name == digest
    plan = _wheelhouse_plan(env={"AGENTEVAL_WHEELHOUSE": str(tmp_path / "wh")})
    assert f"into {tmp_path / 'wh' / 'native' / digest}/" in plan, plan


def test_the_wheelhouse_holds_the_makefile_maf_releases_and_every_extra(tmp_path):
    """make_wheelhouse.sh fetches exactly the MAF releases the Makefile tests (MAF_DEFAULT for .venv,
    MAF_MATRIX for make test-maf-matrix), each as tools/maf-venv installs it, and every pyproject extra."""
    makefile = (ROOT / "Makefile").read_text()
    releases = [pair.split(":") for name in ("MAF_DEFAULT", "MAF_MATRIX")
                for pair in re.search(rf"^{name}\s*:=(.*)$", makefile, flags=re.M).group(1).split()]
    plan = _wheelhouse_plan(str(tmp_path / "wh"))
    planned = re.findall(r"pip install -c <agent-framework-core==(\S+) agent-framework-orchestrations==(\S+)> "
                         rf"\./{INSTRUMENTATION} \.\[test\]$", plan, flags=re.M)
    assert sorted(planned) == sorted(map(tuple, releases)) and len(releases) >= 2, plan
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = re.search(r"pip install \.\[(.*)\]$", plan, flags=re.M).group(1).split(",")
    assert sorted(extras) == sorted(pyproject["project"]["optional-dependencies"]), plan
    # so that pip builds the collector and the instrumentation from the checkout offline
    backends = re.search(r"pip install pip (.*)$", plan, flags=re.M).group(1).split()
    instrumentation = tomllib.loads((ROOT / INSTRUMENTATION / "pyproject.toml").read_text())
    assert set(pyproject["build-system"]["requires"] + instrumentation["build-system"]["requires"]) <= set(backends)
    assert plan.startswith(f"wheelhouse {tmp_path / 'wh'}, ")


def test_offline_without_a_prebuilt_decoder_says_why(tmp_path):
    (tmp_path / "wh" / "native" / ("0" * 64)).mkdir(parents=True)  # built from other sources
    got = subprocess.run([str(ROOT / "tools/native-wheel"), sys.executable], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "PIP_NO_INDEX": "1",
                              "AGENTEVAL_WHEELHOUSE": str(tmp_path / "wh")})
    assert got.returncode == 1
    assert "the wheelhouse holds no compiled decoder built from today's native/ sources" in got.stderr


@pytest.mark.parametrize(("offline", "fails_with", "outcome"), [
    ("1", "dial tcp: lookup proxy.example: no such host", "skipped"),
    ("1", "[ERROR] Could not transfer artifact org.apache.kafka:kafka_2.13", "skipped"),
    # mvn -q (tools/kafka/kafka.sh) with no repository reachable says only this
    ("1", "[ERROR] No plugin found for prefix 'dependency' in the current project and in the plugin groups", "skipped"),
    ("1", "otelcol/build.sh: Go is not installed (https://go.dev/doc/install)", "skipped"),
    ("1", "builder: invalid manifest", "failed"),  # reached its registry and broke: CI fails
    ("", "dial tcp: lookup proxy.example: no such host", "failed"),  # online every part is required
])
def test_a_part_that_cannot_reach_its_registry_is_skipped_offline_only(offline, fails_with, outcome, tmp_path):
    build = tmp_path / "build"
    build.write_text('#!/bin/sh\necho "$MSG" >&2\nexit 3\n')
    build.chmod(0o755)
    got = _bash(f'skipped=(); export AGENTEVAL_REQUIRE_X=1; '
                f'if agenteval_build_or_skip "the part (tests/x.py)" AGENTEVAL_REQUIRE_X "the X registry" {build}; '
                'then echo "ok require=${AGENTEVAL_REQUIRE_X:-}"; else echo "failed"; fi; '
                'for line in "${skipped[@]}"; do echo "skip:$line"; done',
                {"PIP_NO_INDEX": offline, "MSG": fails_with})
    if outcome == "skipped":
        assert "ok require=" in got.stdout.splitlines()
        assert ("skip:the part (tests/x.py): not run, it needs the X registry, which this machine lacks or cannot "
                "reach") in got.stdout
    else:
        assert "failed" in got.stdout.splitlines(), got
    assert fails_with in got.stdout + got.stderr


def test_a_part_that_builds_offline_is_required():
    got = _bash('skipped=(); export AGENTEVAL_REQUIRE_X=1; agenteval_build_or_skip "p" AGENTEVAL_REQUIRE_X "r" '
                'echo built; echo "require=$AGENTEVAL_REQUIRE_X skipped=${#skipped[@]}"', {"PIP_NO_INDEX": "1"})
    assert got.stdout.split() == ["built", "require=1", "skipped=0"]
