"""The reconciler (docs/design.md §1): framework ledger vs chat truth, per executor, then per run.

Pure functions over :mod:`collector.core.model` values; the offline CLI and the live pipeline both call
:func:`reconcile`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from operator import attrgetter
from typing import TypedDict

from collector.core.model import (
    PASS_THRESHOLD,
    VERDICT_SCORES,
    WARN_THRESHOLD,
    Announcement,
    ChatTurn,
    Evidence,
    ExecutorRecord,
    ExecutorVerdict,
    FinishComparison,
    LedgerEntry,
    NoTruthReason,
    Policy,
    RunInput,
    RunVerdict,
    Status,
    Verdict,
    beyond_tolerance,
)
from collector.core.spend import Pricer, price_units

#: The policy of a caller that names none (frozen: one instance serves every call).
DEFAULT_POLICY = Policy()

#: The reasons that say a unit had chat-boundary truth but no framework ledger to compare with it.
_NO_LEDGER = (NoTruthReason.LEDGER_MISSING, NoTruthReason.LEDGER_DERIVED)


def reconcile(run: RunInput, policy: Policy = DEFAULT_POLICY, preset: str = "standard", revision: int = 1,
              pricer: Pricer | None = None) -> RunVerdict:
    """Reconcile every agent unit of one workflow run and derive the run's score and status; with a
    ``pricer``, price each unit and the run (:mod:`collector.core.spend`)."""
    verdicts = tuple(
        reconcile_executor(e, policy)
        for e in sorted(merge_units(run.executors), key=lambda e: e.executor_id.casefold())
    )
    spend = price_units(verdicts, pricer) if pricer is not None else None
    score = run_score(verdicts)
    unchecked = [v.checked for v in verdicts].count(False)
    return RunVerdict(
        status=run_status(score, unchecked, run.partial or run.split),
        score=score,
        executors=verdicts,
        trace_id=run.trace_id,
        root_span_id=run.root_span_id,
        subject=run.subject,
        preset=preset,
        incomplete=run.incomplete,
        split=run.split,
        unattributed_chat_spans=sum(u.calls for u in run.unattributed_chat),
        unattributed_chat=run.unattributed_chat,
        non_agent_executors=run.non_agent_executors,
        workflow_errors=run.workflow_errors,
        notes=run.notes + _unchecked_spend(run) if not verdicts else run.notes,
        coverage_note=coverage_note(score, len(verdicts), unchecked,
                                    [v.no_truth_reason in _NO_LEDGER for v in verdicts].count(True),
                                    run.partial or run.split),
        revision=revision,
        service_name=run.service_name,
        runtime=run.runtime,
        started_at=_utc(run.start_ns),
        duration_s=_duration(run.start_ns, run.end_ns),
        spend=spend,
        **_announcement(run.announcement),
    )


def _unchecked_spend(run: RunInput) -> tuple[str, ...]:
    """Why a run that made chat calls but ran no agent checks nothing, and what would (docs/design.md §1)."""
    if not run.unattributed_chat:
        return ()
    calls = sum(u.calls for u in run.unattributed_chat)
    known = [u.tokens for u in run.unattributed_chat if u.tokens is not None]
    tokens = f", {sum(known)} tokens" if known else ", tokens unknown"
    by = sorted({u.executor for u in run.unattributed_chat if u.executor is not None}, key=str.casefold)
    made = f"by {', '.join(by)}, calling a chat client directly" if by else "with no executor or agent above them"
    return (f"No agent ran in this run: its {calls} chat call(s){tokens} were made {made}, so no framework "
            "ledger reports them and nothing checks them. To check this spend, make these calls through a MAF "
            "agent (an AgentExecutor, or agent.run() inside the executor) so the agent's response is recorded; "
            "until then it is shown here, never dropped.",)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _utc(nanos: int | None) -> str | None:
    """A span time (Unix ns) as ISO 8601 in UTC, to the microsecond; None when unknown: unset (0), or
    outside what a span time (a fixed64) holds."""
    if nanos is None or not 0 < nanos < 2**64:
        return None
    return (_EPOCH + timedelta(microseconds=nanos // 1000)).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _duration(start: int | None, end: int | None) -> float | None:
    """Seconds from ``start`` to ``end`` (Unix ns); None when either is unknown, or the end comes
    before the start (spans timed by clocks that disagree: no duration to tell)."""
    if start is None or end is None or not 0 < start < 2**64 or end < start:  # start as _utc takes it
        return None
    return (end - start) / 1e9


class _Announced(TypedDict, total=False):
    maf_release: str | None
    instrumentation_version: str | None
    instrumentation_status: str | None


def _announcement(said: Announcement | None) -> _Announced:
    if said is None:
        return {}
    return {"maf_release": said.maf_release, "instrumentation_version": said.version,
            "instrumentation_status": said.status}


def merge_units(records: Iterable[ExecutorRecord]) -> list[ExecutorRecord]:
    """Records whose unit names differ only in case are one unit, shown with the first spelling seen."""
    records = list(records)
    if len({r.executor_id.casefold() for r in records}) == len(records):
        return records  # the common case (the live classifier already keys units this way)
    merged: dict[str, ExecutorRecord] = {}
    for r in records:
        key = r.executor_id.casefold()
        seen = merged.get(key)
        if seen is None:
            merged[key] = r
            continue
        ledger = seen.ledger + r.ledger
        merged[key] = ExecutorRecord(
            executor_id=seen.executor_id,
            ledger=ledger,
            turns=seen.turns + r.turns,
            ledger_source=seen.ledger_source if seen.ledger else r.ledger_source,
            span_ids=seen.span_ids + r.span_ids,
            ledger_derived=not ledger and (seen.ledger_derived or r.ledger_derived),
            stacked_chat_spans=seen.stacked_chat_spans + r.stacked_chat_spans,
            chat_layers_disagree=seen.chat_layers_disagree + r.chat_layers_disagree,
            ledger_unjoined=seen.ledger_unjoined + r.ledger_unjoined,
            ledger_duplicates=seen.ledger_duplicates + r.ledger_duplicates,
        )
    return list(merged.values())


def run_score(verdicts: Iterable[ExecutorVerdict]) -> float | None:
    """Mean executor score over executors with truth; ``None`` when nothing was checked."""
    scores = [v.score for v in verdicts if v.score is not None]
    return sum(scores) / len(scores) if scores else None


def coverage_note(score: float | None, units: int, unchecked: int, no_ledger: int = 0,
                  partial: bool = False) -> str | None:
    """AgentEval's coverage note for a partly checked run, worded as AgentEval prints it so CI logs
    read the same on both tools: a pass withheld (WARN), or what a WARN/FAIL score covers. Units
    unchecked for want of a framework ledger (``no_ledger`` of ``unchecked``; AgentEval's files
    always have one) had chat-boundary truth, and are counted apart. A run some of whose spans
    never arrived (``partial``) withholds a pass too: units may be missing."""
    if score is None:
        return None
    if not unchecked:
        if partial and score >= PASS_THRESHOLD:
            return f"the trace is incomplete; a pass on the {units} unit(s) that arrived is withheld"
        return None
    verified = units - unchecked
    no_truth = unchecked - no_ledger
    parts = [f"{no_truth} of {units} executor(s) had no chat-boundary truth"] if no_truth else []
    if no_ledger:
        parts.append(f"{no_ledger} no framework ledger" if parts
                     else f"{no_ledger} of {units} executor(s) had no framework ledger")
    head = " and ".join(parts)
    if score >= PASS_THRESHOLD:
        return f"{head}; a pass on the {verified} verified is withheld"
    return f"{head}; the score covers the {verified} verified"


def run_status(score: float | None, unchecked: int, partial: bool = False) -> Status:
    """docs/design.md §1's table. A pass needs every unit checked: not so in a run some of whose spans never
    arrived (``partial``), where the units of the missing spans could not be."""
    if score is None:
        return Status.PENDING
    if score < WARN_THRESHOLD:
        return Status.FAIL
    if score < PASS_THRESHOLD or unchecked or partial:
        return Status.WARN
    return Status.PASS


_SEQ = attrgetter("seq")


def reconcile_executor(record: ExecutorRecord, policy: Policy = DEFAULT_POLICY) -> ExecutorVerdict:
    ledger = sorted(record.ledger, key=_SEQ)
    turns = sorted(record.turns, key=_SEQ)
    responses: list[ChatTurn] = []
    failed = bare = countless = 0
    summed: int | None = None  # over the responses that carry usage
    for t in turns:  # a response: usage, or a finish reason and no error; failed: an error and no usage
        total = t.usage.total
        if total is not None:
            responses.append(t)
            summed = total if summed is None else summed + total
        elif t.finish_reason is not None and t.error is None:
            responses.append(t)
            countless += 1  # answered, but with no token count to sum
        elif t.error is not None:
            failed += 1
        else:
            bare += 1

    framework_tokens = sum([e.usage.total or 0 for e in ledger]) if ledger else None
    # Failed calls add 0: a unit whose every answered call failed has a truth of 0 tokens.
    truth_tokens = summed if summed is not None else 0 if failed and not responses else None
    no_truth = _no_truth_reason(len(turns), bare, countless, len(responses), ledger, record.ledger_derived,
                                record.ledger_unjoined)

    # A unit with nothing honest to compare shows what each side said, never a difference
    delta = direction = None
    token_diverged = False
    if no_truth is None and framework_tokens is not None and truth_tokens is not None:
        delta = framework_tokens - truth_tokens
        direction = "under" if delta < 0 else "over" if delta > 0 else "equal"
        token_diverged = beyond_tolerance(delta, truth_tokens, policy.tolerance) and (
            direction == "under" or policy.flag_over_reporting)

    framework_in, framework_out, *_ = _sums(ledger)
    truth_in, truth_out, cache_read, cache_write, reasoning = _sums(responses)
    comparisons, aligned = _compare_finish(ledger, responses, _aliases(policy.finish_aliases), no_truth is None)
    # the reasons shown for the unit: of the first invocation whose reasons differ, else the last
    shown = next((c for c in comparisons if c.diverged), None)
    finish_diverged = shown is not None

    if no_truth is not None:
        verdict = Verdict.NO_TRUTH
    elif token_diverged and finish_diverged:
        verdict = Verdict.BOTH
    elif token_diverged:
        verdict = Verdict.TOKEN_MISMATCH
    elif finish_diverged:
        verdict = Verdict.FINISH_MISMATCH
    else:
        verdict = Verdict.AGREE

    # Positional, in field order: this runs per unit of every run, and CPython matches 29 keywords
    # to their parameters one by one (~4.4 us a call; positional ~1.5 us).
    evidence = Evidence(
        framework_tokens, truth_tokens, delta, direction, policy.tolerance,
        shown.framework if shown else _last_entry_reason(ledger),  # framework_finish
        shown.truth if shown else _last_reason(responses),  # truth_finish
        tuple(comparisons), aligned, record.ledger_source,
        not ledger, len(ledger), len(responses), bare, failed,  # ledger_missing ... failed_turns
        tuple([e.span_id for e in ledger if e.span_id]),  # ledger_span_ids
        tuple([t.span_id for t in turns if t.span_id]),  # chat_span_ids
        tuple(turns), tuple(ledger), record.span_ids,  # chat_calls, ledger, executor_span_ids
        framework_in, framework_out, truth_in, truth_out, cache_read, cache_write, reasoning,
        record.stacked_chat_spans, record.chat_layers_disagree, record.ledger_unjoined, record.ledger_duplicates,
    )
    return ExecutorVerdict(record.executor_id, verdict, VERDICT_SCORES.get(verdict), token_diverged, finish_diverged,
                           no_truth, evidence)


def _sums(items: Sequence[LedgerEntry | ChatTurn]) -> tuple[int | None, ...]:
    """The sums of input, output, cache read, cache written and reasoning tokens, each where any item
    reported it. Unrolled: this runs twice per unit of every run (a loop over the five took 3-5x as long)."""
    i = o = read = written = reasoning = None
    for item in items:
        u = item.usage
        if (n := u.input_tokens) is not None:
            i = n if i is None else i + n
        if (n := u.output_tokens) is not None:
            o = n if o is None else o + n
        if (n := u.cache_read_tokens) is not None:
            read = n if read is None else read + n
        if (n := u.cache_write_tokens) is not None:
            written = n if written is None else written + n
        if (n := u.reasoning_tokens) is not None:
            reasoning = n if reasoning is None else reasoning + n
    return i, o, read, written, reasoning


@lru_cache(maxsize=16)
def _aliases(pairs: tuple[tuple[str, str], ...]) -> dict[str, str]:
    return {k.lower(): v.lower() for k, v in pairs}


def _no_truth_reason(turns: int, bare: int, countless: int, responses: int, ledger: Sequence[LedgerEntry],
                     derived: bool, unjoined: int = 0) -> NoTruthReason | None:
    """Why there is nothing honest to compare, first what the chat boundary lacks, then the ledger.

    ``bare``: turns with neither a response nor a failure. A failed call is accounted for (it adds 0
    tokens), never a missing response: a failure is never explained as the Path-2 gap.
    ``countless``: responses with a finish reason and no token count: the truth total is unknown.
    ``unjoined``: ledger spans of the unit's executor that no single run could own: whichever ledger
    the unit has (MAF's agent span, say) may not be the framework's last word on it.
    """
    if not turns:
        return NoTruthReason.NO_CHAT_TRACE
    if bare == turns:
        return NoTruthReason.RESPONSE_MISSING
    if bare or 0 < countless < responses:
        return NoTruthReason.PARTIAL_RESPONSE
    if countless:
        return NoTruthReason.USAGE_MISSING
    if unjoined:
        return NoTruthReason.LEDGER_UNJOINED
    if not ledger:
        return NoTruthReason.LEDGER_DERIVED if derived else NoTruthReason.LEDGER_MISSING
    return None


def _differ(framework: str | None, truth: str | None, aliases: dict[str, str]) -> bool:
    """The reasons differ: a truth side without a reason cannot disprove the framework's."""
    return (truth is not None and truth != framework
            and _normalize(framework, aliases) != _normalize(truth, aliases))


def _normalize(reason: str | None, aliases: dict[str, str]) -> str | None:
    if reason is None:
        return None
    key = reason.strip().lower()
    return aliases.get(key, key) or None


def _last_entry_reason(ledger: Sequence[LedgerEntry]) -> str | None:
    return ledger[-1].finish_reason if ledger else None


def _last_reason(responses: Sequence[ChatTurn]) -> str | None:
    for t in reversed(responses):
        if t.finish_reason is not None:
            return t.finish_reason
    return None


def _compare_finish(
    ledger: Sequence[LedgerEntry], responses: Sequence[ChatTurn], aliases: dict[str, str], compared: bool
) -> tuple[list[FinishComparison], bool]:
    """Per-invocation comparison where both sides carry invocation keys, else the fallback rule: the
    framework reason of the *last* ledger entry (null included: a suppressed final finish is not
    masked by an earlier step) against the last non-null response reason.

    A truth side without any finish reason cannot disprove the framework, so it is not compared;
    nor is a unit with nothing honest to compare (``compared`` false): its pairs are shown, none
    diverged; a unit without a ledger has none.
    """
    if not ledger:
        return [], False
    # The invocations the framework reported on, in order, each with its last entry's reason (one it
    # never answered, the agent having raised, has no framework reason to compare, and its tokens are
    # still in the sums).
    framework: dict[str | None, str | None] = {}
    for e in ledger:
        framework[e.invocation] = e.finish_reason
    # Per invocation only where each ledger entry is exactly one invocation: an entry covering several
    # (a loop or approval middleware re-running the agent inside one call) is one response for all.
    aligned = None not in framework and len(framework) == len(ledger)
    truth: dict[str | None, str] = {}  # each invocation's last non-null response reason
    if aligned:
        for t in responses:
            if t.invocation not in framework:
                aligned = False
                break
            if t.finish_reason is not None:
                truth[t.invocation] = t.finish_reason
    if not aligned:
        fw, reason = _last_entry_reason(ledger), _last_reason(responses)
        return [FinishComparison(None, fw, reason, compared and _differ(fw, reason, aliases))], False
    comparisons: list[FinishComparison] = []
    for key, fw in framework.items():
        reason = truth.get(key)
        comparisons.append(FinishComparison(key, fw, reason, compared and _differ(fw, reason, aliases)))
    return comparisons, aligned
