"""Habits the code keeps (issues 60, 64): ``make test`` lints with the pinned ruff before the tests; no
``noqa`` comments (a rule that does not fit a file is left out in pyproject's
``[tool.ruff.lint.per-file-ignores]``, with why); and the package tells type checkers it is typed
(PEP 561). The types themselves are checked by ``make typecheck`` (pyright), which ``make test`` runs
first too."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import tomllib
from importlib.metadata import version
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
    assert not found, "a rule that does not fit a file is left out in pyproject's [tool.ruff.lint.per-file-ignores], " \
        "with why; a reason a reader needs is a plain comment:\n" + "\n".join(found)


def test_make_test_lints_before_it_runs_the_tests_type_check_or_not():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # run by make test
    for typecheck in ("typecheck", ""):
        planned = subprocess.run(["make", "--dry-run", "test", f"TYPECHECK={typecheck}"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True).stdout.splitlines()
        lint = [i for i, line in enumerate(planned) if line.startswith(".venv/bin/ruff check")]
        tests = [i for i, line in enumerate(planned) if line.startswith(".venv/bin/pytest")]
        assert lint and tests and lint[0] < tests[0], planned


def test_the_linter_is_pinned_and_the_pinned_one_is_installed():
    """Everyone gets the same findings: one exact ruff release in the test extra, the one .venv has."""
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (pin,) = [spec for spec in test_extra if re.match(r"ruff\b", spec)]
    assert re.fullmatch(r"ruff==\d+\.\d+\.\d+", pin), pin
    assert version("ruff") == pin.removeprefix("ruff=="), "make install: .venv's ruff is not the pinned one"


def test_the_wheel_ships_py_typed_as_its_classifier_claims():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "Typing :: Typed" in pyproject["project"]["classifiers"]
    package_data = pyproject["tool"]["setuptools"]["package-data"]["collector"]
    assert (ROOT / "collector" / "py.typed").is_file()
    assert any(fnmatch.fnmatch("py.typed", pattern) for pattern in package_data), package_data
