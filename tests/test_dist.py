"""The install command every NoTruth fix and doc gives an app outside this repository (issue: pip
answered "No matching distribution" to the old one): the release wheels `make dist` builds, installed
with exactly the fix's command into a fresh environment elsewhere, give the instrumentation."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
from pathlib import Path

from collector.core.model import DOTNET_FIXES, DOTNET_INSTALL, NO_TRUTH_FIXES, PYTHON_INSTALL, NoTruthReason

ROOT = Path(__file__).resolve().parent.parent


def _make_dist() -> None:
    with open(ROOT / "instrumentation" / "dotnet" / ".build-docs.lock", "w") as lock:  # test_dotnet_docs builds it too
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(["make", "--no-print-directory", "dist"], cwd=ROOT, capture_output=True, text=True,
                              timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_fix_sentences_install_command_works_for_an_app_elsewhere(tmp_path):
    assert PYTHON_INSTALL in NO_TRUTH_FIXES[NoTruthReason.LEDGER_MISSING]
    assert DOTNET_INSTALL in DOTNET_FIXES[NoTruthReason.LEDGER_MISSING]
    assert not any("pip" in fix for fix in DOTNET_FIXES.values() if fix not in NO_TRUTH_FIXES.values())
    _make_dist()
    command = re.match(r"(pip install .*?), where", PYTHON_INSTALL).group(1).replace("<agenteval>", str(ROOT))
    venv = tmp_path / "app-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # its dependencies from the package index, or offline from the wheelhouse (tools/offline.sh)
    proc = subprocess.run(["bash", "-c", f"source {ROOT}/tools/offline.sh && agenteval_offline {venv}/bin/python && "
                           f"{venv}/bin/python -m {command}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=os.environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = subprocess.run([str(venv / "bin/python"), "-c", "from opentelemetry.instrumentation.maf_fidelity import "
                            "MafFidelityInstrumentor; print(MafFidelityInstrumentor.__module__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert found.stdout.strip() == "opentelemetry.instrumentation.maf_fidelity", found.stderr
