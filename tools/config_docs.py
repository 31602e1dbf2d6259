"""Writes docs/configuration.md from config/collector.yaml, the file that documents every key.

config/collector.yaml is kept equal to the code's defaults and key set by tests/test_config.py; this
page is generated from it (tests/test_docs.py checks it is current), so neither can drift from the
config model. Run ``python tools/config_docs.py`` (or ``make docs``) after changing a key.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "config/collector.yaml"
PAGE = ROOT / "docs/configuration.md"

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w-]*):(?: (?P<value>.*))?$")
_ITEM = re.compile(r"^ *- (?P<value>.*)$")
#: Profiles are a map of name -> profile: each profile key is documented once, as profiles.<name>.KEY.
_PROFILE = re.compile(r"^profiles\.[^.]+\.")


@dataclass
class Key:
    path: str
    comment: list[str]
    default: list[str] = field(default_factory=list)
    section: bool = False


def keys(text: str) -> list[Key]:
    """Every key of the YAML file in order, with the comment lines just above it and its default."""
    found: list[Key] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            comment = []
        elif stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
        elif item := _ITEM.match(line):  # a list value: its key is a leaf after all
            found[-1].default.append(item["value"])
            found[-1].section = False
        elif key := _KEY.match(line):
            indent = len(key["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([name for _, name in stack] + [key["key"]])
            value = key["value"]
            found.append(Key(path, comment, [value] if value else [], section=value is None))
            stack.append((indent, key["key"]))
            comment = []
        else:
            raise ValueError(f"{SOURCE.name}: cannot read line {line!r}")
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(key: Key) -> str:
    return ", ".join(v.strip("'\"") for v in key.default)


def page(text: str) -> str:
    out = [
        "# Configuration",
        "",
        "Every key of `agenteval collector serve --config FILE`, with its default and what it does, generated "
        "from [`config/collector.yaml`](../config/collector.yaml) by `tools/config_docs.py` (a test keeps the "
        "two equal, and that file equal to the code's defaults). With no `--config` the collector runs exactly "
        "these defaults. Unknown keys are an error naming the key; `${env:NAME}` and `${env:NAME:-default}` "
        "are resolved in any value before validation; durations are in seconds.",
        "",
        "`profiles` describe span shapes per runtime (a map of profile name to the keys below, listed as "
        "`profiles.<name>.KEY`); listing `profiles` replaces the shipped ones (`maf-python`, `maf-dotnet`), "
        "whose values are in the YAML file.",
    ]
    seen: set[str] = set()
    top = None
    for key in keys(text):
        path = _PROFILE.sub("profiles.<name>.", key.path)
        if path in seen or path == "profiles.<name>":
            continue
        seen.add(path)
        section = path.split(".")[0]
        if section != top:
            top = section
            out += ["", f"## `{section}`", ""]
            if key.comment:
                out += [" ".join(key.comment), ""]
            if not key.section:  # a top-level value: its default, no table of keys
                out.append(f"Default: `{_default(key)}`.")
                continue
            out += ["| key | default | what it does |", "|---|---|---|"]
            continue
        if key.section:
            if key.comment:
                out.append(f"| `{path}` | | {_cell(' '.join(key.comment))} |")
            continue
        out.append(f"| `{path}` | `{_cell(_default(key))}` | {_cell(' '.join(key.comment))} |")
    return "\n".join(out) + "\n"


def main() -> None:
    generated = page(SOURCE.read_text())
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if PAGE.exists() and PAGE.read_text() == generated else
                 f"{PAGE.relative_to(ROOT)} is stale: run python tools/config_docs.py")
    PAGE.write_text(generated)


if __name__ == "__main__":
    main()
