"""Terminal rendering of run documents (the dicts of :mod:`collector.core.serialize`) with rich.

``bench`` and ``runs show`` both render the stored shape, so what one prints the other prints too.
"""

from __future__ import annotations

import time
import unicodedata
from typing import Any

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

from collector.core.model import (
    fmt_duration,
    fmt_maf_release,
    fmt_over_report,
    fmt_score,
    fmt_started,
    fmt_usd,
    ledger_package,
)
from collector.core.spend import known_spend

STATUS_STYLE = {"PASS": "bold green", "WARN": "bold yellow", "FAIL": "bold red", "PENDING": "bold magenta"}
VERDICT_STYLE = {
    "Agree": "green",
    "TokenMismatch": "yellow",
    "FinishMismatch": "yellow",
    "Both": "red",
    "NoTruth": "magenta",
}


def _visible(ch: str) -> str:
    """A control, format (bidi override, zero-width) or line-separator character as an escape."""
    return f"\\u{ord(ch):04x}" if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") else ch


def shown(text: Any) -> str:
    """Text from a trace (ids, subjects, errors) safe for a terminal: invisible or reordering
    characters escaped so columns stay aligned and nothing is disguised; rich markup escaped."""
    text = str(text)
    if not text.isprintable():
        text = "".join(_visible(ch) for ch in text)
    return escape(text)


def _num(value: Any) -> str:
    return "-" if value is None else str(value)


def executor_table(run: dict[str, Any]) -> Table:
    table = Table(title=f"run {run.get('run_id', '')}  trace {run.get('trace_id') or '-'}", title_justify="left")
    columns: list[tuple[str, JustifyMethod]] = [
        ("unit", "left"), ("verdict", "left"), ("score", "right"), ("framework tok", "right"),
        ("truth tok", "right"), ("delta", "right"), ("finish fw / truth", "left"), ("ledger", "left"),
        ("no-truth reason", "left"),
    ]
    for col, justify in columns:
        table.add_column(col, justify=justify)
    priced = bool((run.get("spend") or {}).get("units_priced"))  # a run nothing could price: no column of "unknown"
    if priced:
        table.add_column("unreported $", justify="right")
    for e in run["executors"]:
        ev = e["evidence"]
        delta = "-" if ev["delta"] is None or not e["checked"] else f"{ev['delta']:+d} {ev['direction']}"
        table.add_row(
            shown(e["executor_id"]),
            f"[{VERDICT_STYLE[e['verdict']]}]{e['verdict']}[/]"
            + (f" [yellow]({over})[/]" if (over := fmt_over_report(ev)) else ""),
            fmt_score(e["score"]),
            "-" if ev["ledger_missing"] else _num(ev["framework_tokens"]),
            _num(ev["truth_tokens"]),
            delta,
            f"{'-' if ev['ledger_missing'] else shown(finish_text(ev['framework_finish'], ev['truth_finish']))} / "
            f"{shown(finish_text(ev['truth_finish']))}",
            shown(ev["ledger_source"]) + (" (missing)" if ev["ledger_missing"] else ""),
            e["no_truth_reason"] or "",
            *([unit_unreported(ev.get("cost"))] if priced else []),
        )
    return table


def unit_findings(ev: dict[str, Any]) -> list[str]:
    """What a unit's evidence says besides its verdict: stacked chat layers (each call counted once),
    responses recorded twice, ledger spans no run could own, layers that disagree, and the parts of
    the truth's counts (docs/instrumentation-stacks.md, docs/verdicts.md)."""
    lines = []
    if over := fmt_over_report(ev):
        lines.append(f"{over}: the framework reported {ev['framework_tokens']:,} tokens, {ev['delta']:,} more than "
                     f"the chat boundary's {ev['truth_tokens']:,} (an over-report is Agree unless "
                     "scoring.flag_over_reporting)")
    if ev.get("stacked_chat_spans"):
        lines.append(f"{ev['stacked_chat_spans']} chat span(s) recorded calls another chat span already records "
                     "(stacked instrumentations): each call counted once")
    if ev.get("ledger_duplicates"):
        lines.append(f"{ev['ledger_duplicates']} ledger span(s) recorded a response another ledger span records "
                     "(the agent decorator beside the workflow's event): each response counted once")
    if ev.get("ledger_unjoined"):
        lines.append(f"{ev['ledger_unjoined']} ledger span(s) named this executor beside the workflow runs without "
                     "their run, and no single run could own them: not compared")
    for d in ev.get("chat_layers_disagree") or ():
        lines.append(f"chat layers disagree (not a verdict): span {d['span_id']} reports {d['tokens']:,} tokens, "
                     f"the span(s) beneath it {', '.join(d['inner_span_ids'])} {d['inner_tokens']:,}")
    parts = [f"{label} {ev[key]:,}" for key, label in (("truth_cache_read_tokens", "cache read"),
                                                        ("truth_cache_write_tokens", "cache write"),
                                                        ("truth_reasoning_tokens", "reasoning"))
             if ev.get(key) is not None]
    if parts:
        lines.append(f"of the truth's tokens: {', '.join(parts)} (parts of input and output, not added on top)")
    return lines


def unit_unreported(cost: dict[str, Any] | None) -> str:
    """A unit's unreported spend for a table cell: a figure, ``unknown``, or ``-`` where not compared."""
    if cost is None or cost["unreported_tokens"] is None:
        return "-"
    return fmt_usd(cost["unreported_usd"])


def run_unreported(run: dict[str, Any]) -> str:
    """The run's unreported spend in a few characters: ``$0.02``, ``$0.02 +1 unknown``, ``unknown``,
    or ``-`` for a run that was not priced."""
    spend = known_spend(run)
    if spend is None:
        return "-"
    unknown = (f" +{spend['units_unknown']} unknown" if spend["units_unknown"] and spend["unreported_usd"] is not None
               else "")
    return fmt_usd(spend["unreported_usd"]) + unknown


def spend_line(run: dict[str, Any]) -> str | None:
    """The run's spend in one line (plain text), or None for a run that was not priced. A figure no
    unit has is ``unknown`` (a run without a ledger has no framework price), never $0.00."""
    spend = known_spend(run)
    if spend is None:
        return None
    tokens = "not compared" if spend["unreported_tokens"] is None else f"{spend['unreported_tokens']:,} tokens"
    if not spend["units_priced"]:
        return (f"spend  unknown: no unit's model could be priced ({spend['units_unknown']} unit(s); {tokens} "
                "unreported)")
    line = (f"spend  framework {fmt_usd(spend['framework_usd'])}, truth {fmt_usd(spend['truth_usd'])}, "
            f"unreported spend {fmt_usd(spend['unreported_usd'])} ({tokens})")
    if spend["units_unknown"]:
        n = spend["units_unknown"]
        whose = "unit's" if n == 1 else "units'"
        line += f"; {n} {whose} cost unknown (in no sum)"
    return line


def finish_text(value: str | None, truth: str | None = None) -> str:
    """A finish reason as the run page words it: the framework's, missing where the chat boundary
    has one, is called out as suppressed."""
    return value or ("none (suppressed)" if truth else "none reported")


def _no_truth_groups(executors: list[dict[str, Any]]) -> dict[tuple, list[str]]:
    """Units left unchecked, by what is said of them (reason, explanation, failed calls, fix): said
    once for all the units it is true of, as the run page's cards do."""
    groups: dict[tuple, list[str]] = {}
    for e in executors:
        if e["no_truth_reason"]:
            key = (e["no_truth_reason"], e["no_truth_explanation"], e["evidence"].get("failed_turns"),
                   e.get("no_truth_fix"))
            groups.setdefault(key, []).append(e["executor_id"])
    return groups


def status_line(run: dict[str, Any]) -> str:
    status = run["status"]
    head = f"[{STATUS_STYLE[status]}]{status}[/]"
    tags = f"preset {run['preset']}, cost tier {run['cost_tier']}, revision {run['revision']}"
    if run["incomplete"]:
        tags += ", incomplete trace"
    if status == "PENDING":
        return f"{head}  nothing was checked: no agent unit could be checked honestly ({tags})"
    return (
        f"{head}  score {fmt_score(run['score'])}  checked {run['checked']}/"
        f"{run['checked'] + run['unchecked']} agent units ({tags})"
    )


def print_run(console: Console, run: dict[str, Any]) -> None:
    if run.get("subject") or run.get("service_name"):
        service = f"  service.name {shown(run['service_name'])}" if run.get("service_name") else ""
        console.print(f"subject [bold]{shown(run.get('subject') or '-')}[/]{service}")
    if run.get("started_at"):
        took = "unknown" if run.get("duration_s") is None else fmt_duration(run["duration_s"])
        console.print(f"started {fmt_started(run['started_at'])}, duration {took}", markup=False)
    if run["executors"]:
        console.print(executor_table(run))
    for (reason, explanation, failed, fix), units in _no_truth_groups(run["executors"]).items():
        extra = f" ({failed} chat call(s) failed)" if failed else ""
        console.print(f"  [magenta]{', '.join(map(shown, units))}[/]: {reason} - {escape(explanation)}{extra}")
        if fix:
            console.print(f"    fix: {escape(fix)}")
    for e in run["executors"]:
        for line in unit_findings(e["evidence"]):
            console.print(f"  [bold]{shown(e['executor_id'])}[/]: {escape(line)}")
    if not run["executors"]:
        console.print("  no agent ran in this run")
    if run.get("non_agent_executors"):
        console.print(f"  not reconciled (no agent ran): {', '.join(map(shown, run['non_agent_executors']))}")
    for chat in run.get("unattributed_chat") or ():
        where = (f"made by {shown(chat['executor'])}, which hosts no agent" if chat["executor"]
                 else "with no executor or agent above them")
        tokens = f", {chat['tokens']:,} tokens," if chat["tokens"] is not None else ""
        console.print(f"  note: {chat['calls']} chat call(s){tokens} {where} (not a unit)")
    if run.get("maf_release") or run.get("instrumentation_version"):
        console.print(f"  {fmt_maf_release(run.get('maf_release'))}, {ledger_package(run.get('runtime') == 'dotnet')} "
                      f"{run.get('instrumentation_version') or '-'} ({run.get('instrumentation_status') or '-'})",
                      markup=False)
    for error in run.get("workflow_errors") or ():
        console.print(f"  [red]workflow error[/] (not scored): {shown(error)}")
    for note in run.get("notes") or ():
        console.print(f"  note: {shown(note)}")
    console.print(status_line(run))
    if run.get("coverage_note"):
        console.print(f"  {run['coverage_note']}", markup=False)
    if spend := spend_line(run):
        console.print(spend, markup=False, highlight=False)
        for e in run["executors"]:
            cost = e["evidence"].get("cost") or {}
            if cost.get("unknown"):
                console.print(f"  {shown(e['executor_id'])}: cost unknown: {shown(cost['unknown'])}", highlight=False)


#: Narrower than this, `runs list` shows each run id as a prefix `runs show` takes (a live run's id
#: is 49 characters), and leaves out the source and revision.
WHOLE_IDS_WIDTH = 140


def runs_table(rows: list[dict[str, Any]], width: int = 160) -> Table:
    """Each run id on one line, to copy into ``runs show``: whole, or below WHOLE_IDS_WIDTH the
    shortest prefix that tells it from the other runs listed (at least 16 characters)."""
    whole = width >= WHOLE_IDS_WIDTH
    ids = {r["run_id"]: r["run_id"] for r in rows} if whole else distinct_prefixes([r["run_id"] for r in rows])
    table = Table(title="runs, newest first" if whole else "runs, newest first (run ids shortened to a unique prefix)")
    table.add_column("run id", no_wrap=True)
    table.add_column("updated (UTC)", overflow="fold", min_width=10)
    table.add_column("subject", overflow="fold", ratio=1)
    for col in ("status", "score", "checked"):
        table.add_column(col, no_wrap=True)
    if whole:
        table.add_column("source", overflow="fold", ratio=1)
    if width >= 100:
        table.add_column("MAF", no_wrap=True)
    if whole:
        table.add_column("rev", no_wrap=True)
    for r in rows:
        run_id = ids[r["run_id"]]
        if r["trace_id"] and not r["run_id"].startswith(r["trace_id"]):
            run_id += f"\n[dim]trace {r['trace_id'] if whole else r['trace_id'][:16]}[/]"
        updated = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["updated_at"])) if r.get("updated_at") else "-"
        cells = [run_id, updated, shown(r["subject"] or "-"),
                 f"[{STATUS_STYLE[r['status']]}]{r['status']}[/]" + ("\n[dim]incomplete[/]" if r["incomplete"] else ""),
                 fmt_score(r["score"]), f"{r['checked']}/{r['checked'] + r['unchecked']}"]
        if whole:
            cells.append(shown(r["source"]))
        if width >= 100:
            cells.append(shown(r.get("maf_release") or "-"))
        if whole:
            cells.append(str(r["revision"]))
        table.add_row(*cells)
    return table


def distinct_prefixes(run_ids: list[str], shortest: int = 16) -> dict[str, str]:
    """Each run id cut to the shortest prefix (at least ``shortest`` characters) no other shown id
    starts with, so two runs of one trace (ids ``<trace id>-<span id>``) stay apart, and what
    is shown is what ``runs show`` takes."""
    ordered = sorted(run_ids)
    out = {}
    for index, run_id in enumerate(ordered):
        length = shortest
        for other in ordered[max(index - 1, 0):index] + ordered[index + 1:index + 2]:  # the nearest in order
            common = next((i for i, (a, b) in enumerate(zip(run_id, other, strict=False)) if a != b),
                          min(len(run_id), len(other)))
            length = max(length, common + 1)
        out[run_id] = run_id[:length]
    return out


def demo_table(results: list, width: int = 160) -> Table:
    """Below 100 columns the scenario text goes (it is printed under the table instead); unit
    verdicts are one per line and never cut."""
    narrow = width < 100
    table = Table(title="agenteval demo: what the collector concluded", expand=narrow)
    table.add_column("workflow", overflow="fold")
    table.add_column("expected", no_wrap=True)
    table.add_column("collector", no_wrap=True)
    table.add_column("score", no_wrap=True)
    table.add_column("units", no_wrap=True)
    if not narrow:
        table.add_column("scenario", ratio=1)
    for r in results:
        run = r.run
        status = f"[{STATUS_STYLE[run['status']]}]{run['status']}[/]" if run else "[red]no verdict[/]"
        units = "\n".join(f"{shown(e['executor_id'])}={e['verdict']}" for e in run["executors"]) if run else "-"
        row = [r.name, r.expected, status, fmt_score(run["score"]) if run else "-", units]
        table.add_row(*row, *([] if narrow else [r.about]))
    return table
