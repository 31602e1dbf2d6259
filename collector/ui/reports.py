"""CI reports of run documents (docs/outputs.md "CI reports"): JUnit XML (the run a suite, each unit a
test case: a mismatch a failure with its evidence, NoTruth skipped with its reason and fix, Agree
passed) and Markdown fit for a CI job summary (status, score, a table of units, the fix texts).

Both are written run by run as a file streams through ``bench``, so a large file's report costs no
more memory than its runs do one at a time. Neither changes an exit code.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any, TextIO

from collector.core.model import fmt_score, fmt_usd
from collector.core.spend import known_spend
from collector.ui.render import finish_text, spend_line, unit_unreported

#: A run status as a job summary shows it, at a glance.
STATUS_MARK = {"PASS": "✅", "WARN": "⚠️", "FAIL": "❌", "PENDING": "⏳"}
#: The JUnit test cases' class name: what CI systems group the units of every run under.
CLASSNAME = "agenteval.workflow-trace-fidelity"


def divergence(unit: dict[str, Any]) -> str:
    """What diverged in a checked unit, in plain words (a JUnit failure's message, a summary's line)."""
    ev, parts = unit["evidence"], []
    if unit["token_diverged"]:
        share = f" ({100 * abs(ev['delta']) / ev['truth_tokens']:.1f}% {ev['direction']})" if ev["truth_tokens"] else ""
        parts.append(f"the framework reported {ev['framework_tokens']:,} tokens; the chat boundary summed "
                     f"{ev['truth_tokens']:,} over {ev['response_turns']} chat call(s): {ev['delta']:+,}{share}, "
                     f"beyond the {ev['tolerance'] * 100:.1f}% tolerance")
    if unit["finish_diverged"]:
        parts.append(f"the framework's finish reason is {finish_text(ev['framework_finish'], ev['truth_finish'])}; "
                     f"the chat boundary's is {finish_text(ev['truth_finish'])}")
    cost = ev.get("cost") or {}
    if cost.get("unreported_usd"):
        parts.append(f"unreported spend {fmt_usd(cost['unreported_usd'])}")
    return "; ".join(parts)


def evidence_text(unit: dict[str, Any]) -> str:
    """The numbers and span ids behind a unit's verdict (a JUnit failure's body)."""
    ev = unit["evidence"]
    lines = [f"verdict: {unit['verdict']} (score {fmt_score(unit['score'])})",
             f"tokens: framework {ev['framework_tokens']} / truth {ev['truth_tokens']} (delta {ev['delta']})",
             f"finish: framework {finish_text(ev['framework_finish'], ev['truth_finish'])} / truth "
             f"{finish_text(ev['truth_finish'])}",
             f"ledger: {ev['ledger_source']}, {ev['ledger_entries']} "
             f"{'entry' if ev['ledger_entries'] == 1 else 'entries'}; "
             f"chat calls: {ev['response_turns']} "
             f"answered, {ev.get('failed_turns') or 0} failed, {ev['request_turns']} without a response"]
    if ev.get("cost"):
        cost = ev["cost"]
        lines.append(f"cost: framework {fmt_usd(cost['framework_usd'])} / truth {fmt_usd(cost['truth_usd'])}, "
                     f"unreported {fmt_usd(cost['unreported_usd'])}"
                     + (f" (unknown: {cost['unknown']})" if cost.get("unknown") else ""))
    for label, key in (("chat spans", "chat_span_ids"), ("ledger spans", "ledger_span_ids"),
                       ("executor spans", "executor_span_ids")):
        if ev.get(key):
            more = ev.get(f"{key}_more") or 0
            lines.append(f"{label}: {', '.join(ev[key])}" + (f" and {more} more" if more else ""))
    return "\n".join(lines)


def _suite(doc: dict[str, Any]) -> ET.Element:
    units = doc["executors"]
    failures = sum(1 for u in units if u["checked"] and u["verdict"] != "Agree")
    skipped = sum(1 for u in units if not u["checked"])
    attrs = {"name": f"{doc.get('subject') or '(no subject)'} run {doc['run_id']}", "tests": str(len(units)),
             "failures": str(failures), "errors": "0", "skipped": str(skipped),
             "time": f"{doc.get('duration_s') or 0:.6f}", "id": doc["run_id"]}
    if doc.get("started_at"):
        attrs["timestamp"] = doc["started_at"]
    suite = ET.Element("testsuite", attrs)
    properties = ET.SubElement(suite, "properties")
    for name in ("run_id", "trace_id", "status", "score", "exit_code", "source", "preset", "maf_release"):
        if doc.get(name) is not None:
            ET.SubElement(properties, "property", {"name": name, "value": str(doc[name])})
    if (spend := known_spend(doc)) is not None:  # a figure no unit has is "unknown", never 0.0
        for name in ("unreported_usd", "unreported_tokens"):
            value = "unknown" if spend[name] is None else str(spend[name])
            ET.SubElement(properties, "property", {"name": name, "value": value})
    for unit in units:
        case = ET.SubElement(suite, "testcase", {"name": unit["executor_id"], "classname": CLASSNAME, "time": "0"})
        if not unit["checked"]:
            reason = unit["no_truth_reason"]
            skip = ET.SubElement(case, "skipped", {"type": reason, "message": f"NoTruth {reason}: "
                                                   f"{unit['no_truth_explanation']}"})
            skip.text = f"What would fix it: {unit['no_truth_fix']}" if unit.get("no_truth_fix") else None
        elif unit["verdict"] != "Agree":
            failure = ET.SubElement(case, "failure", {"type": unit["verdict"], "message": divergence(unit)})
            failure.text = evidence_text(unit)
    out = [f"{doc['status']}: score {fmt_score(doc['score'])}, checked {doc['checked']}/{len(units)} unit(s), "
           f"exit code {doc['exit_code']}"]
    if doc.get("coverage_note"):
        out.append(doc["coverage_note"])
    if line := spend_line(doc):
        out.append(line)
    out.extend(f"workflow error (not scored): {e}" for e in doc.get("workflow_errors") or ())
    out.extend(f"note: {n}" for n in doc.get("notes") or ())
    ET.SubElement(suite, "system-out").text = "\n".join(out)
    return suite


class JUnitReport:
    """``<testsuites>`` written to ``out`` one ``<testsuite>`` (run) at a time."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        out.write('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites name="agenteval workflow-trace-fidelity">\n')

    def add(self, doc: dict[str, Any]) -> None:
        element = _suite(doc)
        ET.indent(element, level=1)
        self.out.write("  " + ET.tostring(element, encoding="unicode") + "\n")

    def finish(self, status: str | None = None, exit_code: int | None = None) -> None:
        """The closing tag (the overall status is each suite's ``status`` property)."""
        self.out.write("</testsuites>\n")


def _cell(value: Any) -> str:
    """Text for a Markdown table cell: pipes and line breaks would end the cell or the row."""
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    text = _cell(value).replace("`", "'")
    return f"`{text}`"


def markdown_run(doc: dict[str, Any], trace_url: str | None = None) -> str:
    """One run as Markdown: its status, score, spend, a table of units, what diverged and the fixes."""
    status, units = doc["status"], doc["executors"]
    lines = [f"### {STATUS_MARK[status]} {status}: {_cell(doc.get('subject') or '(no subject)')}", ""]
    trace = doc.get("trace_id")
    if trace and trace_url:
        trace_text = (f", trace [{_code(trace)}]"
                      f"({trace_url.format(trace_id=trace, span_id=doc.get('root_span_id') or '')})")
    else:
        trace_text = f", trace {_code(trace)}" if trace else ""
    lines.append(f"Score **{fmt_score(doc['score'])}** over {doc['checked']} of {len(units)} agent unit(s), "
                 f"exit code {doc['exit_code']}. Run {_code(doc['run_id'])}{trace_text}.")
    if doc.get("coverage_note"):
        lines += ["", f"> {_cell(doc['coverage_note'])}"]
    if spend := spend_line(doc):
        lines += ["", f"**Spend:** {_cell(spend.removeprefix('spend  '))}"]
    if units:
        lines += ["", "| unit | verdict | score | framework tokens | truth tokens | delta | finish (framework / truth) "
                      "| unreported $ |", "|---|---|---:|---:|---:|---:|---|---:|"]
        for u in units:
            ev = u["evidence"]
            delta = "-" if ev["delta"] is None else f"{ev['delta']:+,} {ev['direction']}"
            reason = f" `{u['no_truth_reason']}`" if u["no_truth_reason"] else ""
            lines.append(f"| {_code(u['executor_id'])} | {u['verdict']}{reason} | {fmt_score(u['score'])} | "
                         f"{'-' if ev['ledger_missing'] else _num(ev['framework_tokens'])} | "
                         f"{_num(ev['truth_tokens'])} "
                         f"| {delta} | {_cell(finish_text(ev['framework_finish'], ev['truth_finish']))} / "
                         f"{_cell(finish_text(ev['truth_finish']))} | "
                         f"{unit_unreported(ev.get('cost'))} |")
    else:
        lines += ["", "No agent ran in this run."]
    diverged = [u for u in units if u["checked"] and u["verdict"] != "Agree"]
    if diverged:
        lines += ["", "**What diverged**", ""]
        lines += [f"- {_code(u['executor_id'])} {u['verdict']}: {_cell(divergence(u))}" for u in diverged]
    fixes: dict[tuple, list[str]] = {}
    for u in units:
        if u["no_truth_reason"]:
            fixes.setdefault((u["no_truth_reason"], u["no_truth_explanation"], u.get("no_truth_fix")), []).append(
                u["executor_id"])
    if fixes:
        lines += ["", "**Why some units could not be checked**", ""]
        for (reason, explanation, fix), names in fixes.items():
            lines.append(f"- `{reason}` ({', '.join(map(_code, names))}): {_cell(explanation)}.")
            if fix:
                lines.append(f"  *Fix:* {_cell(fix)}.")
    for error in doc.get("workflow_errors") or ():
        lines += ["", f"- workflow error (not scored): {_cell(error)}"]
    return "\n".join(lines) + "\n"


def _num(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


class MarkdownReport:
    """A job summary written to ``out`` run by run; the overall status and exit code last."""

    def __init__(self, out: TextIO, trace_url: str | None = None) -> None:
        self.out, self.trace_url = out, trace_url
        self.counts: dict[str, int] = {}
        out.write("## agenteval workflow-trace-fidelity\n\n")

    def add(self, doc: dict[str, Any]) -> None:
        self.counts[doc["status"]] = self.counts.get(doc["status"], 0) + 1
        self.out.write(markdown_run(doc, self.trace_url) + "\n")

    def finish(self, status: str | None = None, exit_code: int | None = None) -> None:
        """The overall result; ``status`` None: the command failed (exit 1), said so."""
        runs = ", ".join(f"{STATUS_MARK[s]} {n} {s}" for s, n in sorted(self.counts.items())) or "no run"
        if status is None:
            self.out.write(f"**Result: error** (exit code 1) after {runs}: see the job's log.\n")
        else:
            self.out.write(f"**Result: {STATUS_MARK[status]} {status}** (exit code {exit_code}) over {runs}.\n")
