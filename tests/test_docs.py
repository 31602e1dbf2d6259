"""The README and docs/ stay true: every command they show runs or parses as written, every config key
they name exists, every link leads somewhere, and the configuration page is generated from the file
the config model is checked against (so none of them can drift from the code)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
import yaml

from collector.config import CollectorConfig
from collector.ui.cli import app

from conftest import AGENTEVAL

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, *PAGES]

_spec = importlib.util.spec_from_file_location("config_docs", ROOT / "tools/config_docs.py")
config_docs = importlib.util.module_from_spec(_spec)
sys.modules["config_docs"] = config_docs  # dataclasses look their module up
_spec.loader.exec_module(config_docs)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_blocks(path: Path, languages: tuple[str, ...]) -> Iterator[str]:
    """The text of every fenced code block of one of these languages."""
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", path.read_text(), flags=re.M | re.S):
        if match[1] in languages:
            yield match[2]


def commands(path: Path) -> Iterator[list[str]]:
    """Every command line of the shell blocks (continuations joined, comments and env prefixes cut)."""
    for block in code_blocks(path, ("sh", "bash")):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                words.pop(0)
            if words:
                yield words


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move reference material into docs/"
    links = set(re.findall(r"\]\((docs/[\w.-]+\.md)", README.read_text()))
    # one click from the README: how to run it, how to point an app at it, what each verdict means,
    # how to deploy it with replicas, and the index of everything else
    assert {"docs/running.md", "docs/maf.md", "docs/verdicts.md", "docs/deployment.md", "docs/index.md"} <= links


def test_every_docs_page_is_listed_on_the_index():
    index = (ROOT / "docs/index.md").read_text()
    missing = [p.name for p in PAGES if p.name != "index.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/index.md does not list {missing}"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_every_relative_link_leads_somewhere(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)):
            broken.append(target)
    assert not broken, f"{_name(path)}: links to nothing: {broken}"


def test_the_configuration_page_is_generated_from_the_documented_config():
    """config/collector.yaml equals the config model (tests/test_config.py); this page is made from it."""
    assert (ROOT / "docs/configuration.md").read_text() == config_docs.page(config_docs.SOURCE.read_text()), (
        "docs/configuration.md is stale: run `make docs`")


def test_every_configuration_section_shows_its_defaults():
    """A top-level value (`instance`, `shutdown_delay`) was a heading over an empty table of keys."""
    sections = re.split(r"^## ", (ROOT / "docs/configuration.md").read_text(), flags=re.M)[1:]
    for section in sections:
        name = section.split("\n", 1)[0]
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        assert rows or re.search(r"^Default: `[^`]*`\.$", section, flags=re.M), f"{name}: no default shown"
        assert "| key | default | what it does |" not in section or rows, f"{name}: an empty table"


#: Keys an earlier version had, which the config refuses by name with their successor's (collector/config.py).
RETIRED_KEYS = {"receivers.http.trace_link"}


def _config_keys() -> set[str]:
    def leaves(value: object, prefix: str) -> Iterator[str]:
        yield prefix
        if isinstance(value, dict):
            for key, child in value.items():
                yield from leaves(child, f"{prefix}.{key}")

    # the Helm chart's values (deployment.md names them as `store.existingSecret`...) are keys too
    helm = yaml.safe_load((ROOT / "deploy/helm/agenteval/values.yaml").read_text())
    keys: set[str] = {k for section, value in helm.items() for k in leaves(value, section)}
    for section, value in CollectorConfig().model_dump().items():
        if section == "profiles":  # a map of names: any profile's keys count, under any name
            for profile in value.values():
                keys |= {k.replace(k.split(".")[0], "profiles.<name>", 1) for k in leaves(profile, "x")}
            keys.add(section)
        else:
            keys |= set(leaves(value, section))
    return keys


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_every_config_key_named_exists(path):
    """A key named in backticks (`assembly.quiet_period`, `receivers.http.trace_link`) is a key of the
    config model; named without its section (`quiet_period`) it is checked where the page names it whole."""
    sections = set(CollectorConfig.model_fields)
    known = _config_keys()
    alternatives = "|".join(sections)
    named = re.findall(rf"`((?:{alternatives})(?:\.[\w<>]+)+)`", path.read_text())
    named = [re.sub(r"^profiles\.[\w-]+\.", "profiles.<name>.", k) for k in named]
    # a placeholder segment (`pricing.models.<model>`) stands for any key of the map before it
    named = [k.split(".<")[0] if ".<" in k and not k.startswith("profiles.<name>") else k for k in named]
    unknown = sorted({k for k in named if k not in known | RETIRED_KEYS and not k.endswith(".KEY")})
    assert not unknown, f"{_name(path)} names config keys the collector does not have: {unknown}"


def _parse(words: list[str]) -> None:
    """Parse a command line as the CLI would, without running it (click's parser, resolving subcommands)."""
    command = typer.main.get_command(app)
    ctx = command.make_context("agenteval", list(words))
    while isinstance(command, typer.core.TyperGroup) and (rest := ctx._protected_args + ctx.args):
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)


#: The docs' placeholders for numbers (`--limit N`, `--timeout S`, `--trace-window SPANS`).
_NUMBER_PLACEHOLDERS = {"N", "S", "SPANS"}


def _agenteval_lines() -> Iterator[tuple[str, list[str]]]:
    for path in DOCUMENTS:
        for words in commands(path):
            if Path(words[0]).name == "agenteval":
                yield _name(path), words[1:]


@pytest.mark.parametrize(("where", "args"), list(_agenteval_lines()),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_every_agenteval_command_shown_parses(where, args):
    # a usage synopsis (`[--preset smoke|standard|audit-grade]`) is read as one of the lines it allows:
    # optional parts included, each choice's first alternative; placeholders (FILE, RUN_ID) are values
    args = [a.strip("[]").split("|")[0] for a in args]
    args = ["1" if a in _NUMBER_PLACEHOLDERS else a for a in args]
    try:
        _parse(args)
    except typer._click.exceptions.UsageError as exc:
        pytest.fail(f"{where}: `agenteval {' '.join(args)}` does not parse: {exc.format_message()}")


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+):", text, flags=re.M)) | {
        t for line in re.findall(r"^\.PHONY:(.*)$", text, flags=re.M) for t in line.split()}


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_every_make_target_and_path_shown_exists(path):
    targets = _make_targets()
    wrong = []
    for words in commands(path):
        if words[0] == "make" and len(words) > 1 and words[1] not in targets:
            wrong.append(" ".join(words))
        if words[:2] == ["pip", "install"]:
            wrong += [w for w in words[2:] if w.startswith("./") and not (ROOT / w.split("[")[0]).exists()]
    assert not wrong, f"{_name(path)}: {wrong}"


def test_the_readme_offline_check_runs_as_written(tmp_path):
    """The README's `bench` line, run as written from the checkout: the FAIL it shows, exit 9."""
    [line] = [w for w in commands(README) if w[1:3] == ["bench", "workflow-trace-fidelity"]]
    proc = subprocess.run([AGENTEVAL, *line[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "AGENTEVAL_STORE": str(tmp_path / "runs.db")})
    assert proc.returncode == 9, proc.stderr
    assert "FAIL" in proc.stdout and "TokenMismatch" in proc.stdout


def test_the_readme_instrumentation_snippet_imports():
    [snippet] = [b for b in code_blocks(README, ("python",)) if "MafFidelityInstrumentor" in b]
    imports = "\n".join(line for line in snippet.splitlines() if line.startswith(("from ", "import ")))
    exec(compile(imports, "README.md", "exec"), {})


def test_the_layout_page_names_every_module():
    """docs/layout.md left out the Kafka receiver, the hand-over, pricing, spend and the CI reports."""
    layout = (ROOT / "docs/layout.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "collector").rglob("*.py"))
               if p.stem != "__init__" and "api" not in p.parts and f"`{p.stem}`" not in layout]
    assert not missing, f"docs/layout.md does not name {missing}"


@pytest.mark.parametrize(("term", "definition"), [("ledger", "*ledger*"), ("truth", "*chat truth*"),
                                                   ("unit", "*agent unit*"), ("Path-2", "*Path-2*")])
def test_the_readme_defines_each_term_where_it_first_uses_it(term, definition):
    text = README.read_text()
    first = re.search(rf"(?<![\w-]){re.escape(term)}(?![\w-])", text)
    assert first and text.find(definition) in range(first.start() - len(definition), first.start() + 1), (
        f"README.md uses {term!r} at {text[first.start() - 40:first.end() + 20]!r} before defining it")
    if term == "Path-2":  # the demo's path2-pending row is the first a reader sees of it: defined under it
        assert text.find(definition) < text.find("##", text.find("path2-pending"))


def test_the_readme_says_verdict_spans_are_exported_only_with_an_otlp_endpoint():
    """The README listed verdict spans under "What you get"; by default none are exported."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| verdict spans"))
    assert "exporters.otlp.endpoint" in row
    assert CollectorConfig().exporters.otlp.endpoint is None and "By default nothing leaves the machine" in text


def test_every_doc_page_the_repository_cites_exists():
    """otelcol/manifest.yaml cited docs/topologies.md, a page that never existed (the Kafka topology
    is in docs/scale-out.md): every `docs/NAME.md` named in a tracked file outside docs/ is a page."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = set()
    for name in files:
        path = ROOT / name
        if (name.startswith("docs/") or name == "tests/test_docs.py" or not path.is_file()
                or path.suffix in (".png", ".pb", ".db", ".gz", ".nupkg")):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        missing |= {(name, cited) for cited in re.findall(r"\bdocs/([\w.-]+\.md)", text)
                    if not (ROOT / "docs" / cited).exists()}
    assert not missing, sorted(missing)
