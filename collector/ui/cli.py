"""The ``agenteval`` command line (typer + rich). Configuration of logging happens here, at the edge."""

from __future__ import annotations

import gc
import json
import os
import shlex
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from typer._click import Context, HelpFormatter  # typer's own click: no click of its own since 0.20
from typer.core import TyperGroup

from collector.config import CollectorConfig, ConfigError, load_config, split_endpoint
from collector.core.model import EXIT_ERROR, STATUS_EXIT_CODES, Preset, Status
from collector.core.reconcile import reconcile
from collector.formats.loader import TRACE_WINDOW, NoSteps, TraceFileError, iter_runs
from collector.live.journal import JournalError
from collector.store import (
    STORE_ENV,
    RunStore,
    StoredRun,
    StoreError,
    StoreUnavailable,
    instance_name,
    open_store,
)
from collector.ui.render import demo_table, print_run, runs_table, shown
from collector.ui.reports import JUnitReport, MarkdownReport, markdown_run


class _WholeDescriptions(TyperGroup):
    """A group's help lists each command with its whole first sentence: click cuts it at the line's
    end, with "...", however much the reader needed the rest."""

    def format_commands(self, ctx: Context, formatter: HelpFormatter) -> None:
        rows = [(name, command.get_short_help_str(limit=sys.maxsize)) for name in self.list_commands(ctx)
                if (command := self.get_command(ctx, name)) is not None and not command.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


#: Plain (click) help: typer's rich help labels every flag ``<bool>`` and splits long choice lists.
#: Every option that takes a value names it (``metavar``): typer's default is the Python type (``<str>``).
_HELP = {"no_args_is_help": True, "rich_markup_mode": None, "cls": _WholeDescriptions}
app = typer.Typer(help="Workflow fidelity: framework accounting vs the chat boundary, per agent.",
                  add_completion=False, **_HELP)
bench_app = typer.Typer(help="Offline reconciliation of recorded traces.", **_HELP)
runs_app = typer.Typer(help="Stored runs.", **_HELP)
app.add_typer(bench_app, name="bench")
app.add_typer(runs_app, name="runs")
collector_app = typer.Typer(help="The live OTLP collector.", **_HELP)
app.add_typer(collector_app, name="collector")

def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"agenteval {version('agenteval-collector')}")
        raise typer.Exit(0)


@app.callback()
def _logging(
    _: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Log lines (JSON) go to stderr, never into a command's output; warnings and up by default."""
    from collector.live.logs import configure

    configure("warning")


#: Piped output (CI logs, tests) is 160 columns wide unless $COLUMNS says otherwise.
_WIDTH = None if os.environ.get("COLUMNS") else 160
out = Console(width=None if sys.stdout.isatty() else _WIDTH)
err = Console(stderr=True, width=None if sys.stderr.isatty() else _WIDTH)

#: With several runs in one file, the process exits with the most severe status.
SEVERITY = (Status.FAIL, Status.PENDING, Status.WARN, Status.PASS)

StoreOpt = Annotated[str | None, typer.Option(
    "--store", metavar="<path|url>",
    help="Run store: a SQLite path or a postgresql:// URL (default: the config's store.url, else $AGENTEVAL_STORE, "
         "else the user data dir).")]
ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", metavar="<file>", help="Collector YAML config (default: embedded defaults).")]


class _Fatal(Exception):
    """A setup / IO error: printed on stderr, exit code 1."""


def _check_grpc(option: str, endpoint: str, ca_file: Path | None) -> None:
    """A collector gRPC address option (OTLP/gRPC and the API share the port) and the optional CA
    bundle, or a one-line error naming them."""
    if "://" in endpoint:
        raise _Fatal(f"{option}: {endpoint!r} is a URL; give the collector's gRPC port as host:port, e.g. "
                     "127.0.0.1:4317 (drop the scheme)")
    try:
        split_endpoint(endpoint)
    except ValueError as exc:
        raise _Fatal(f"{option}: {exc} (the collector's gRPC port, e.g. 127.0.0.1:4317)") from None
    if ca_file is not None and not ca_file.is_file():
        raise _Fatal(f"--ca-file {ca_file}: no such file: give the PEM CA bundle that signed the collector's "
                     "certificate")


def _statuses(values: list[str] | None) -> tuple[str, ...]:
    statuses = tuple(s.upper() for s in values or ())
    if bad := [s for s in statuses if s not in Status.__members__]:
        raise _Fatal(f"--status: expected PASS, WARN, FAIL or PENDING, got {', '.join(bad)}")
    return statuses


def _subject_filter(subject: str | None) -> str | None:
    if subject is not None and not subject.strip():
        raise _Fatal("--subject: empty: give a subject to filter on, or leave the option out for all runs")
    return subject


#: click's exit code for usage errors; docs/design.md §1 wants bad arguments to exit 1 like other setup errors.
_USAGE_EXIT = 2


def _open_store(url: str | None, cfg: CollectorConfig | None = None, existing: bool = False) -> RunStore:
    """``--store``, else the config's ``store.url``, else the default; the password from the config.
    ``existing``: to read (see :func:`open_store`)."""
    cfg = cfg or CollectorConfig()
    try:
        return open_store(url or cfg.store.url, cfg.store.password(), cfg.store.pool_size, existing,
                          cfg.store.max_span_ids_per_unit)
    except StoreUnavailable as exc:
        raise _Fatal(f"{exc}: the store cannot be reached now; retry later") from exc
    except (StoreError, ConfigError) as exc:
        raise _Fatal(str(exc)) from exc


def _config(path: Path | None):
    try:
        return load_config(path)
    except ConfigError as exc:
        raise _Fatal(str(exc)) from exc


@contextmanager
def _progress(path: Path, show: bool) -> Iterator[Callable[[int], None]]:
    """A byte-progress callback: a transient bar on a terminal, nothing otherwise."""
    if not show or not path.is_file():
        yield lambda n: None
        return
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=out, transient=True) as progress:
        task = progress.add_task(f"reading {path.name}", total=path.stat().st_size)
        yield lambda n: progress.advance(task, n)


#: Runs per store transaction while a file streams through.
STORE_BATCH = 500


@bench_app.command("workflow-trace-fidelity")
def bench_workflow_trace_fidelity(
    workflow_trace: Annotated[Path, typer.Option(
        "--workflow-trace", metavar="<file|->",
        help="AgentEval WorkflowTrace JSON, workflow-trace/v1 JSON, OTLP JSON or OTLP JSON Lines (detected by "
             "content); - reads standard input.")],
    subject: Annotated[str, typer.Option(
        "--subject", metavar="<name>", help="What is being evaluated (recorded on the run).")],
    preset: Annotated[Preset, typer.Option("--preset", help="Informational; never changes scoring.")] = "standard",
    as_json: Annotated[bool, typer.Option(
        "--json",
        help='Print {"runs": [...], "status", "exit_code"}, one run per line (schema: '
             'collector/formats/schemas/run.schema.json).')] = False,
    trace_window: Annotated[int, typer.Option(
        "--trace-window", min=0, metavar="<spans>",
        help="JSON Lines: spans read after a trace's last span before it is reconciled (its root "
             "must have arrived).")] = TRACE_WINDOW,
    junit: Annotated[Path | None, typer.Option(
        "--junit", metavar="<file>",
        help="Also write a JUnit XML report: each run a test suite, each agent unit a test case (a mismatch "
             "a failure with its evidence, NoTruth skipped with its reason and fix).")] = None,
    markdown: Annotated[Path | None, typer.Option(
        "--markdown", metavar="<file>",
        help="Also write a Markdown report fit for a CI job summary (e.g. $GITHUB_STEP_SUMMARY): status, "
             "score, a table of units, the fixes.")] = None,
    store: Annotated[str | None, typer.Option(
        "--store", metavar="<path|url>",
        help="Keep the runs in this run store: a SQLite path or a postgresql:// URL (default: the --config's "
             "store.url, else $AGENTEVAL_STORE, else none: the runs are checked, not kept).")] = None,
    config: ConfigOpt = None,
) -> None:
    """Reconcile a recorded workflow trace; exit 0 PASS, 10 WARN, 9 FAIL, 11 PENDING, 1 error.

    Runs stream out (printed, and stored in batches where a store is named) as their traces complete,
    so memory stays flat however large the file. Without --store, a --config store.url or
    $AGENTEVAL_STORE nothing is kept: an offline check never lands among a live collector's runs.
    """
    if not subject.strip():
        raise _Fatal("--subject: empty: name what is being evaluated (e.g. the workflow), so its runs can be found")
    cfg = _config(config)
    policy, matcher, host = cfg.scoring.policy(), cfg.matcher(), instance_name()
    pricer = None
    if cfg.pricing.enabled:
        from collector.outputs.pricing import Pricing  # genai-prices' data: loaded by the commands that price

        pricer = Pricing(cfg.pricing)
    keep = store or (cfg.store.url if config else None) or os.environ.get(STORE_ENV)
    # Nothing named: the runs go through a store of their own, removed at the end (one document shape
    # for the table, --json and the reports), never the live collector's default one.
    scratch = None if keep else tempfile.TemporaryDirectory(prefix="agenteval-bench-")
    try:
        db = _open_store(keep if scratch is None else str(Path(scratch.name) / "runs.db"), cfg)
        try:
            reports = _reports(junit, markdown, cfg.ui.trace_url)
        except _Fatal:
            db.close()
            raise
    except _Fatal as exc:
        if scratch is not None:
            scratch.cleanup()
        if as_json:  # the promised envelope, even when nothing could start
            print(json.dumps({"runs": [], "status": None, "exit_code": EXIT_ERROR, "error": str(exc)}))
        raise
    statuses: set[Status] = set()
    batch: list[StoredRun] = []
    stored = 0

    def flush() -> None:
        nonlocal stored
        written = set(db.save_many(batch))
        stored_docs = {doc["run_id"]: doc for doc in db.docs(written)}  # as stored: one shape everywhere
        for doc in (stored_docs[item.run_id] for item in batch if item.run_id in written):
            for report in reports:
                report.add(doc)
            if as_json:
                print(("" if stored == 0 else ",\n") + json.dumps(doc), end="")
            else:
                print_run(out, doc)
            stored += 1
        batch.clear()

    source = "stdin" if str(workflow_trace) == "-" else f"file:{workflow_trace}"
    if as_json:
        print('{"runs": [')
    try:
        with _progress(workflow_trace, out.is_terminal and not as_json) as on_bytes:
            for run_input in iter_runs(workflow_trace, matcher, on_bytes, trace_window):
                verdict = replace(reconcile(run_input, policy, preset, pricer=pricer), subject=subject)
                statuses.add(verdict.status)
                batch.append(StoredRun(uuid.uuid4().hex, source, verdict, host))
                if len(batch) >= STORE_BATCH:
                    flush()
        flush()
    except NoSteps as exc:
        code = STATUS_EXIT_CODES[Status.PENDING]
        note = f"{exc}: PENDING (exit {code}), nothing stored"
        _close_reports(reports, Status.PENDING.value, code)
        if as_json:
            print(f'\n], "status": "PENDING", "exit_code": {code}, "note": {json.dumps(note)}}}')
        err.print(note, highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(code) from None
    except (TraceFileError, StoreError) as exc:
        if as_json:
            print(f'\n], "status": null, "exit_code": {EXIT_ERROR}, "error": {json.dumps(str(exc))}}}')
        kept = f" ({stored} run(s) completed before it were stored)" if stored else ""
        _close_reports(reports)
        raise _Fatal(f"{exc}{kept}") from exc
    finally:
        db.close()
        if scratch is not None:
            scratch.cleanup()
    worst = min(statuses, key=SEVERITY.index)
    code = STATUS_EXIT_CODES[worst]
    _close_reports(reports, worst.value, code)
    if as_json:
        print(f'\n], "status": "{worst.value}", "exit_code": {code}}}')
    elif scratch is not None:
        err.print(f"[dim]not stored: {stored} run(s) checked; to keep them for `agenteval runs`, give --store "
                  f"<path|url> (or $AGENTEVAL_STORE)[/]")
    else:
        again = (f" --store {shlex.quote(db.display)}" if store
                 else f" --config {shlex.quote(str(config))}" if config else "")
        err.print(f"[dim]stored {stored} run(s) in {escape(db.display)} (`agenteval runs list{escape(again)}`)[/]")
    raise typer.Exit(code)


def _reports(junit: Path | None, markdown: Path | None, trace_url: str | None) -> list:
    """The CI reports asked for, their files opened now, so a path that cannot be written fails
    before anything is reconciled."""
    reports: list = []
    try:
        if junit is not None:
            reports.append(JUnitReport(junit.open("w", encoding="utf-8")))
        if markdown is not None:
            reports.append(MarkdownReport(markdown.open("w", encoding="utf-8"), trace_url))
    except OSError as exc:
        _close_reports(reports)
        option = "--junit" if junit is not None and not reports else "--markdown"
        raise _Fatal(f"{option} {exc.filename}: {exc.strerror}") from None
    return reports


def _close_reports(reports: list, status: str | None = None, code: int | None = None) -> None:
    for report in reports:
        report.finish(status, code)
        report.out.close()


@runs_app.command("list")
def runs_list(
    status: Annotated[list[str] | None, typer.Option(
        "--status", metavar="<PASS|WARN|FAIL|PENDING>",
        help="Only this status: PASS, WARN, FAIL or PENDING (repeatable).")] = None,
    subject: Annotated[str | None, typer.Option(
        "--subject", metavar="<name>", help="Only runs of this subject.")] = None,
    maf_release: Annotated[str | None, typer.Option(
        "--maf-release", metavar="<version>",
        help="Only runs whose spans came from this agent-framework-core release (1.26.0, or 1.26 for every "
             "1.26.x).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, metavar="<n>", help="At most this many runs.")] = 50,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print a JSON array of runs (schema: collector/formats/schemas/run.schema.json).")] = False,
    store: StoreOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List stored runs, newest first."""
    statuses, subject = _statuses(status), _subject_filter(subject)
    cfg = _config(config) if config else None
    db = _open_store(store, cfg, existing=True)
    try:
        rows = db.list_runs(statuses, subject, limit, with_docs=True, maf_release=maf_release)
        history = "" if as_json else db.history(cfg.store.retention.max_age if cfg else None)
    finally:
        db.close()
    if as_json:
        print(json.dumps(rows, indent=2))
    elif rows:
        out.print(runs_table(rows, out.width))
        out.print(f"[dim]{escape(history)}[/]")
    else:
        given = [f"{flag} {value}" for flag, values in (("--status", statuses),
                                                         ("--subject", [subject] if subject else []),
                                                         ("--maf-release", [maf_release] if maf_release else []))
                 for value in values]
        out.print(f"no stored run matches {' '.join(given)}" if given else "no runs stored", markup=False)


@runs_app.command("show")
def runs_show(
    # described in the docstring: typer would label the argument with its Python type, <str>
    run_id: Annotated[str, typer.Argument(metavar="RUN_ID", hidden=True)],
    as_json: Annotated[bool, typer.Option(
        "--json",
        help="Print the run as JSON (schema: collector/formats/schemas/run.schema.json); the same as "
             "--format json.")] = False,
    output: Annotated[str, typer.Option(
        "--format", metavar="<table|json|junit|markdown>",
        help="table (default), json, junit (JUnit XML: the run a suite, each unit a test case) or "
             "markdown (a CI job summary).")] = "table",
    store: StoreOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Show one stored run with per-unit evidence.

    RUN_ID: the run's id, or a unique prefix of it (as `runs list` and `watch` show it).
    """
    if output not in ("table", "json", "junit", "markdown"):
        raise _Fatal(f"--format: expected table, json, junit or markdown, got {output!r}")
    cfg = _config(config) if config else None
    db = _open_store(store, cfg, existing=True)
    try:
        doc = db.get_run(run_id)
        if doc is None:
            raise _Fatal(db.missing_run(run_id))
    finally:
        db.close()
    if as_json or output == "json":
        print(json.dumps(doc, indent=2))
    elif output == "junit":
        report = JUnitReport(sys.stdout)
        report.add(doc)
        report.finish()
    elif output == "markdown":
        print(markdown_run(doc, (cfg or CollectorConfig()).ui.trace_url), end="")
    else:
        out.print(f"source {doc['source']}")
        print_run(out, doc)


LOG_LEVEL_ENV = "AGENTEVAL_LOG_LEVEL"


@collector_app.command("serve")
def collector_serve(
    config: ConfigOpt = None,
    store: StoreOpt = None,
    log_level: Annotated[str | None, typer.Option(
        "--log-level", metavar="LEVEL",
        help=f"debug, info, warning or error (default: ${LOG_LEVEL_ENV}, else the config's logging.level).")] = None,
) -> None:
    """Receive OTLP spans, reconcile every workflow trace, emit verdicts (Ctrl-C / SIGTERM to stop)."""
    import asyncio

    from collector.config import Logging
    from collector.live.logs import configure
    from collector.live.server import serve

    cfg = _config(config)
    if store is not None:
        cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"url": store})})
    level = log_level or os.environ.get(LOG_LEVEL_ENV) or cfg.logging.level
    try:
        level = Logging.model_validate({"level": level.lower()}).level
    except ValueError:
        raise _Fatal(f"--log-level / ${LOG_LEVEL_ENV}: {level!r}: expected debug, info, warning or error") from None
    configure(level)
    try:
        asyncio.run(serve(cfg))
    except (StoreError, ConfigError, JournalError, OSError) as exc:
        raise _Fatal(str(exc)) from exc


@collector_app.command("validate")
def collector_validate(
    config: Annotated[Path, typer.Option("--config", metavar="<file>", help="The collector YAML config to check.")],
) -> None:
    """Check a config as `serve` does before it starts, starting nothing (as `otelcol validate`): exit 0,
    or 1 with the error `serve` would give.

    Keys, values and ${env:...} references, secrets (token and password files or variables), TLS
    files, the kafka receiver's client. Not checked: whether the ports are free and the store
    reachable, which depend on the moment and the machine that runs it.
    """
    from collector.live.server import check

    cfg = _config(config)
    try:
        check(cfg)
    except ConfigError as exc:
        raise _Fatal(str(exc)) from exc
    out.print(f"{config}: valid", markup=False, highlight=False)


@app.command("demo")
def demo_command(
    endpoint: Annotated[str | None, typer.Option(
        "--endpoint", metavar="<host:port|url>",
        help="The collector's OTLP endpoint (default: 127.0.0.1:4317 for grpc, http://127.0.0.1:4318 for "
             "http/protobuf).")] = None,
    protocol: Annotated[str, typer.Option(
        "--protocol", metavar="<grpc|http/protobuf>", help="The OTLP protocol.")] = "grpc",
    api: Annotated[str | None, typer.Option(
        "--api", metavar="<host:port>",
        help="The collector's gRPC port (host:port), where the verdicts are read back (default: --endpoint "
             "for grpc; for http/protobuf, --endpoint's host on port 4317). Behind an OpenTelemetry "
             "Collector, an agenteval replica's port.")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", metavar="<seconds>", help="Seconds to wait for the verdicts.")] = 30.0,
    token_env: Annotated[str, typer.Option(
        "--token-env", metavar="<variable>",
        help="Environment variable holding the bearer token, if auth is on.")] = "AGENTEVAL_TOKEN",
    ca_file: Annotated[Path | None, typer.Option(
        "--ca-file", metavar="<file>", help="CA bundle (PEM): connect with TLS.")] = None,
) -> None:
    """Run real MAF workflows (scripted chat client, no network) against a running collector and show
    the verdicts it reached, read back over its gRPC API whatever store it uses.

    Needs the [maf] extra and the MAF instrumentation; make install has both. By hand, in the
    source tree:

    \b
      pip install '.[maf]' \\
        ./instrumentation/opentelemetry-instrumentation-maf-fidelity
    """
    import os
    from urllib.parse import urlsplit

    try:
        from collector.demo.demo import DemoError, DemoTarget, demo
    except ImportError as exc:
        if (exc.name or "").startswith("opentelemetry.instrumentation"):
            raise _Fatal(f"agenteval demo needs the MAF fidelity instrumentation ({exc}): pip install "
                         "./instrumentation/opentelemetry-instrumentation-maf-fidelity (in the agenteval source "
                         "tree)") from None
        raise _Fatal(f"agenteval demo needs the [maf] extra ({exc}): pip install 'agenteval-collector[maf]'") from None
    if protocol not in ("grpc", "http/protobuf"):
        raise _Fatal(f"--protocol: expected grpc or http/protobuf, got {protocol!r}")
    if protocol == "grpc":
        endpoint = endpoint or "127.0.0.1:4317"
        _check_grpc("--endpoint", endpoint, None)
        api = api or endpoint
    else:
        endpoint = endpoint or "http://127.0.0.1:4318"
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise _Fatal(f"--endpoint: http/protobuf needs a URL such as http://127.0.0.1:4318, got {endpoint!r}")
        api = api or (f"[{url.hostname}]:4317" if ":" in url.hostname else f"{url.hostname}:4317")
    _check_grpc("--api", api, ca_file)
    target = DemoTarget(endpoint, protocol, api, os.environ.get(token_env) or None,
                        str(ca_file) if ca_file else None, token_env)
    try:
        results, problem = demo(target, timeout)
    except DemoError as exc:
        raise _Fatal(str(exc)) from None
    out.print(demo_table(results, out.width))
    for r in results:
        if out.width < 100:
            out.print(f"  {r.name}: {r.about}", highlight=False)
        if r.run:
            out.print(f"  {r.name}: [dim]agenteval runs show {r.run['run_id'][:12]}[/]", highlight=False)
        for e in (r.run or {}).get("executors", []):
            if e["no_truth_reason"]:
                out.print(f"  {r.name}/{shown(e['executor_id'])}: {e['no_truth_reason']} - {e['no_truth_explanation']}")
    if any(r.run for r in results) and endpoint not in ("127.0.0.1:4317", "http://127.0.0.1:4318"):
        out.print("[dim](with the collector's --config, or --store, unless it uses the default store)[/]")
    missing = [r.name for r in results if r.run is None]
    if missing:
        why = problem or (f"did the collector at {api} receive the spans sent to {endpoint}? (behind an "
                          "OpenTelemetry Collector, pass --api with the agenteval replica's gRPC port)")
        raise _Fatal(f"no verdict from {api} within {timeout:g}s for {', '.join(missing)}: {why}")
    raise typer.Exit(0 if all(r.ok for r in results) else EXIT_ERROR)


@app.command("watch")
def watch_command(
    endpoint: Annotated[str, typer.Option(
        "--endpoint", metavar="<host:port>", help="The collector's gRPC port.")] = "127.0.0.1:4317",
    subject: Annotated[str | None, typer.Option(
        "--subject", metavar="<name>", help="Only runs of this subject.")] = None,
    status: Annotated[list[str] | None, typer.Option(
        "--status", metavar="<PASS|WARN|FAIL|PENDING>", help="Only this status (repeatable).")] = None,
    rows: Annotated[int, typer.Option("--rows", min=1, metavar="<n>", help="Runs kept in the live table.")] = 20,
    replay: Annotated[int | None, typer.Option(
        "--replay", min=0, metavar="<n>", help="Recent stored runs shown on (re)connect (default: --rows).")] = None,
    count: Annotated[int | None, typer.Option(
        "--count", min=1, metavar="<n>",
        help="Exit 0 after this many new verdicts (runs replayed on connect are shown but not counted).")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="JSON Lines: one run per line (schema: collector/formats/schemas/run.schema.json).")] = False,
    token_env: Annotated[str, typer.Option(
        "--token-env", metavar="<variable>",
        help="Environment variable holding the bearer token, if auth is on.")] = "AGENTEVAL_TOKEN",
    ca_file: Annotated[Path | None, typer.Option(
        "--ca-file", metavar="<file>", help="CA bundle (PEM): connect with TLS.")] = None,
) -> None:
    """Follow run verdicts live as the collector stores them; reconnects if the collector restarts."""
    import os

    from collector.ui.watch import WatchFatal, WatchTarget, watch

    statuses = _statuses(status)
    _check_grpc("--endpoint", endpoint, ca_file)
    target = WatchTarget(endpoint, _subject_filter(subject), statuses, os.environ.get(token_env) or None,
                         str(ca_file) if ca_file else None)
    try:
        watch(target, out, err, rows, rows if replay is None else replay, count, as_json)
    except WatchFatal as exc:
        raise _Fatal(str(exc)) from exc
    except KeyboardInterrupt:
        pass


def main() -> None:
    """Entry point: usage errors and setup/IO errors both exit 1 (docs/design.md §1)."""
    # Decoding allocates many short-lived objects that never form cycles: collect the young
    # generation every 50,000 allocations instead of 700 (measured ~10-30% on bench/offline.py).
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        app()
    except _Fatal as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_ERROR)
    except SystemExit as exc:
        if exc.code == _USAGE_EXIT:
            sys.exit(EXIT_ERROR)
        raise
