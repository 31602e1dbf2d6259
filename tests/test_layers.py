"""The package layers hold: `lint-imports` (import-linter) checks pyproject's ``[tool.importlinter]``
contracts — each package imports only the layers below it (collector/__init__.py), the store backends
share an interface and never import each other, and ``collector.core`` stays free of protobuf, gRPC,
SQLite, psycopg and structlog."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout
