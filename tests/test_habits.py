"""Habits the code keeps without a linter (issue 60): no ``noqa`` comments answering a linter that
never runs here, and the package tells type checkers it is typed (PEP 561). The types themselves are
checked by ``make typecheck`` (pyright), which ``make test`` runs first."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOQA = re.compile(r"#\s*noqa\b", re.IGNORECASE)


def test_no_source_file_holds_a_noqa_comment():
    files = subprocess.run(["git", "ls-files", "-z", "--", "collector", "tests", "bench", "tools", "instrumentation"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    found = [f"{name}:{number}: {line.strip()}"
             for name in files if name.endswith((".py", ".pyi"))
             for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1)
             if NOQA.search(line)]
    assert not found, "a reason a reader needs is a plain comment; nothing here runs the linter a noqa answers:\n" \
        + "\n".join(found)


def test_the_wheel_ships_py_typed_as_its_classifier_claims():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "Typing :: Typed" in pyproject["project"]["classifiers"]
    package_data = pyproject["tool"]["setuptools"]["package-data"]["collector"]
    assert (ROOT / "collector" / "py.typed").is_file()
    assert any(fnmatch.fnmatch("py.typed", pattern) for pattern in package_data), package_data
