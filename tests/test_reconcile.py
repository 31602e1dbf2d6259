"""The reconciler's rules (docs/design.md §1), table-driven, plus properties that must hold for any input."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.core.model import (
    ChatTurn,
    ExecutorRecord,
    LedgerEntry,
    NoTruthReason,
    Policy,
    RunInput,
    Status,
    Usage,
    Verdict,
)
from collector.core.reconcile import reconcile, reconcile_executor, run_status


def entry(i=None, o=None, total=None, finish="stop", seq=0, inv=None):
    return LedgerEntry(Usage(i, o, total), finish, seq, inv)


def resp(i=None, o=None, total=None, finish="stop", seq=0, inv=None):
    return ChatTurn(Usage(i, o, total), finish, seq, inv)


def req(seq=0, inv=None):
    return ChatTurn(Usage(), None, seq, inv)


def failed(seq=0, inv=None, error="429 Too Many Requests"):
    return ChatTurn(Usage(), None, seq, inv, None, error)


def ex(ledger=(), turns=(), eid="e", derived=False):
    return ExecutorRecord(eid, tuple(ledger), tuple(turns), "test", (), derived)


CASES = {
    "agree": (ex([entry(100, 50)], [resp(100, 50)]), Verdict.AGREE, None),
    "under_reported_tokens": (ex([entry(10, 5)], [resp(100, 50)]), Verdict.TOKEN_MISMATCH, None),
    "suppressed_finish_reason": (ex([entry(100, 50, finish=None)], [resp(100, 50, finish="content_filter")]),
                                 Verdict.FINISH_MISMATCH, None),
    "different_finish_reason": (ex([entry(100, 50, finish="stop")], [resp(100, 50, finish="length")]),
                                Verdict.FINISH_MISMATCH, None),
    "both": (ex([entry(1, 1, finish=None)], [resp(100, 50, finish="length")]), Verdict.BOTH, None),
    "finish_case_insensitive": (ex([entry(100, 50, finish="STOP")], [resp(100, 50, finish="stop")]),
                                Verdict.AGREE, None),
    "no_chat_trace": (ex([entry(100, 50)], []), Verdict.NO_TRUTH, NoTruthReason.NO_CHAT_TRACE),
    "response_missing": (ex([entry(100, 50)], [req(0), req(1)]), Verdict.NO_TRUTH, NoTruthReason.RESPONSE_MISSING),
    "partial_response": (ex([entry(100, 50)], [resp(100, 50), req(1)]), Verdict.NO_TRUTH,
                         NoTruthReason.PARTIAL_RESPONSE),
    "total_used_when_split_unknown": (ex([entry(total=150)], [resp(100, 50)]), Verdict.AGREE, None),
    "ledger_missing_is_a_visibility_gap": (ex([], [resp(100, 50)]), Verdict.NO_TRUTH, NoTruthReason.LEDGER_MISSING),
    "derived_ledger_proves_nothing": (ex([], [resp(100, 50)], derived=True), Verdict.NO_TRUTH,
                                      NoTruthReason.LEDGER_DERIVED),
    "failed_call_is_not_path2": (ex([], [failed()]), Verdict.NO_TRUTH, NoTruthReason.LEDGER_MISSING),
    "failed_call_then_retry_adds_zero": (ex([entry(100, 50)], [failed(0), resp(100, 50, seq=1)]), Verdict.AGREE, None),
    "failed_call_beside_bare_request_is_partial": (ex([entry(100, 50)], [failed(0), req(1)]), Verdict.NO_TRUTH,
                                                   NoTruthReason.PARTIAL_RESPONSE),
    "truth_without_finish_reason_cannot_disprove": (ex([entry(100, 50, finish="stop")], [resp(100, 50, finish=None)]),
                                                    Verdict.AGREE, None),
}


@pytest.mark.parametrize("name", CASES)
def test_verdict_table(name):
    record, verdict, reason = CASES[name]
    v = reconcile_executor(record)
    assert v.verdict is verdict
    assert v.no_truth_reason is reason
    assert (v.score is None) == (verdict is Verdict.NO_TRUTH)


@pytest.mark.parametrize(
    "framework,expected",
    [(98, Verdict.AGREE), (97, Verdict.TOKEN_MISMATCH), (100, Verdict.AGREE)],
)
def test_tolerance_boundary_exactly_two_percent_under_agrees(framework, expected):
    # truth 100 tokens: 98 is exactly 2% under (Agree), 97 is beyond it.
    v = reconcile_executor(ex([entry(total=framework)], [resp(60, 40)]))
    assert v.verdict is expected


def test_tolerance_boundary_is_exact_for_large_totals():
    truth = 1_000_000
    at = reconcile_executor(ex([entry(total=980_000)], [resp(total=truth)]))
    over = reconcile_executor(ex([entry(total=979_999)], [resp(total=truth)]))
    assert at.verdict is Verdict.AGREE and over.verdict is Verdict.TOKEN_MISMATCH


def test_over_reporting_is_recorded_but_not_flagged_by_default():
    v = reconcile_executor(ex([entry(200, 100)], [resp(100, 50)]))
    assert v.verdict is Verdict.AGREE
    assert v.evidence.direction == "over" and v.evidence.delta == 150


def test_over_reporting_flagged_when_configured():
    v = reconcile_executor(ex([entry(200, 100)], [resp(100, 50)]), Policy(flag_over_reporting=True))
    assert v.verdict is Verdict.TOKEN_MISMATCH


def test_looped_executor_is_not_flagged():
    ledger = [entry(100, 10, seq=i, inv=str(i)) for i in range(3)]
    turns = [resp(100, 10, seq=i, inv=str(i)) for i in range(3)]
    v = reconcile_executor(ex(ledger, turns))
    assert v.verdict is Verdict.AGREE
    assert v.evidence.framework_tokens == v.evidence.truth_tokens == 330
    assert v.evidence.aligned and len(v.evidence.finish_comparisons) == 3


def test_invocation_alignment_finds_the_suppressed_reason_in_the_second_pass():
    ledger = [entry(100, 10, finish="stop", seq=0, inv="a"), entry(100, 10, finish=None, seq=1, inv="b")]
    turns = [resp(100, 10, finish="stop", seq=0, inv="a"), resp(100, 10, finish="length", seq=1, inv="b")]
    v = reconcile_executor(ex(ledger, turns))
    assert v.verdict is Verdict.FINISH_MISMATCH
    diverged = [c for c in v.evidence.finish_comparisons if c.diverged]
    assert [(c.invocation, c.framework, c.truth) for c in diverged] == [("b", None, "length")]


def test_the_finish_reasons_shown_are_those_of_the_invocation_that_diverged():
    """Three passes, the second's content_filter suppressed: the unit's finish reasons (shown as
    "the framework's finish reason is ...") were the last pass's, stop / stop, beside FinishMismatch."""
    ledger = [entry(100, 10, finish="stop", seq=0, inv="a"), entry(100, 10, finish=None, seq=1, inv="b"),
              entry(100, 10, finish="stop", seq=2, inv="c")]
    turns = [resp(100, 10, finish="stop", seq=0, inv="a"), resp(100, 10, finish="content_filter", seq=1, inv="b"),
             resp(100, 10, finish="stop", seq=2, inv="c")]
    v = reconcile_executor(ex(ledger, turns))
    assert v.verdict is Verdict.FINISH_MISMATCH
    assert (v.evidence.framework_finish, v.evidence.truth_finish) == (None, "content_filter")
    agree = reconcile_executor(ex(ledger[:1] + ledger[2:], turns[:1] + turns[2:]))
    assert (agree.verdict, agree.evidence.framework_finish, agree.evidence.truth_finish) == (Verdict.AGREE, "stop",
                                                                                             "stop")


def test_alignment_compares_the_last_chat_response_of_each_invocation():
    # A tool loop: the first call ends tool_calls, the last ends stop; the framework reports stop.
    ledger = [entry(300, 30, finish="stop", seq=0, inv="a")]
    turns = [resp(100, 10, finish="tool_calls", seq=0, inv="a"), resp(200, 20, finish="stop", seq=1, inv="a")]
    assert reconcile_executor(ex(ledger, turns)).verdict is Verdict.AGREE


def test_unaligned_fallback_compares_the_last_framework_reason_with_the_last_truth_reason():
    ledger = [entry(50, 5, finish=None, seq=0), entry(50, 5, finish="stop", seq=1)]
    turns = [resp(50, 5, finish="length", seq=0), resp(50, 5, finish="stop", seq=1)]
    v = reconcile_executor(ex(ledger, turns))
    assert not v.evidence.aligned
    assert v.verdict is Verdict.AGREE


def test_suppressed_final_finish_is_not_masked_by_an_earlier_step():
    # AgentEval's rule (docs/design.md §1): the framework reason is the last entry's, null included.
    ledger = [entry(50, 5, finish="stop", seq=0), entry(50, 5, finish=None, seq=1)]
    turns = [resp(50, 5, finish="stop", seq=0), resp(50, 5, finish="content_filter", seq=1)]
    v = reconcile_executor(ex(ledger, turns))
    assert v.verdict is Verdict.FINISH_MISMATCH
    assert (v.evidence.framework_finish, v.evidence.truth_finish) == (None, "content_filter")


def test_failed_turns_are_counted_in_the_evidence_and_add_nothing():
    v = reconcile_executor(ex([entry(100, 50)], [resp(100, 50, seq=0), failed(1)]))
    assert v.verdict is Verdict.AGREE
    ev = v.evidence
    assert (ev.truth_tokens, ev.failed_turns, ev.response_turns, ev.request_turns) == (150, 1, 1, 0)


def test_an_invocation_that_failed_is_not_a_suppressed_finish():
    # Invocation "a" raised after a tool_calls response, so the framework reported only "b".
    ledger = [entry(100, 10, finish="stop", seq=2, inv="b")]
    turns = [resp(50, 5, finish="tool_calls", seq=0, inv="a"), failed(1, inv="a"),
             resp(100, 10, finish="stop", seq=2, inv="b")]
    v = reconcile_executor(ex(ledger, turns))
    assert not v.finish_diverged and v.token_diverged  # 55 tokens of "a" were never reported


def test_unit_names_are_case_insensitive_and_keep_the_first_spelling():
    run = reconcile(RunInput((ex([entry(100, 0)], [], "Writer"), ex([], [resp(100, 0)], "writer"))))
    (unit,) = run.executors
    assert unit.executor_id == "Writer" and unit.verdict is Verdict.AGREE and run.status is Status.PASS


def test_unaligned_all_null_framework_reasons_diverge():
    v = reconcile_executor(ex([entry(50, 5, finish=None)], [resp(50, 5, finish="content_filter")]))
    assert v.verdict is Verdict.FINISH_MISMATCH


def test_finish_aliases_map_reasons_before_comparing():
    record = ex([entry(10, 10, finish="end_turn")], [resp(10, 10, finish="stop")])
    assert reconcile_executor(record, Policy(finish_aliases=())).verdict is Verdict.FINISH_MISMATCH
    assert reconcile_executor(record, Policy(finish_aliases=(("end_turn", "stop"),))).verdict is Verdict.AGREE
    assert reconcile_executor(record).verdict is Verdict.AGREE  # the shipped map (Anthropic's end_turn)
    assert reconcile_executor(record).evidence.framework_finish == "end_turn"  # raw values are kept


@pytest.mark.parametrize("derived", [False, True], ids=["missing", "derived"])
def test_a_unit_without_a_ledger_claims_no_framework_numbers(derived):
    """Its verdict span said framework tokens 0, delta -990 "under" and a diverged finish pair: a
    backend counting under-reports by direction counted a unit that was never compared."""
    v = reconcile_executor(ex([], [resp(900, 90)], derived=derived))
    ev = v.evidence
    assert v.verdict is Verdict.NO_TRUTH and ev.ledger_missing and ev.truth_tokens == 990
    assert (ev.framework_tokens, ev.delta, ev.direction, ev.framework_finish) == (None, None, None, None)
    assert ev.finish_comparisons == () and not v.token_diverged and not v.finish_diverged


def test_a_unit_left_unchecked_compares_nothing():
    """Partial truth (one call never answered): its sums and reasons are shown, not compared."""
    v = reconcile_executor(ex([entry(100, 50, finish="stop")], [resp(40, 5, finish="tool_calls"), req(1)]))
    ev = v.evidence
    assert v.no_truth_reason is NoTruthReason.PARTIAL_RESPONSE
    assert (ev.framework_tokens, ev.truth_tokens, ev.delta, ev.direction) == (150, 45, None, None)
    assert (ev.framework_finish, ev.truth_finish) == ("stop", "tool_calls")
    assert not any(c.diverged for c in ev.finish_comparisons)


def test_the_coverage_note_says_what_an_unchecked_unit_lacked():
    """A unit whose ledger is missing had chat-boundary truth: the note said it had none."""
    run = reconcile(RunInput((ex([entry(100, 50)], [resp(100, 50)], "a"), ex([], [resp(100, 50)], "b"))))
    assert run.coverage_note == "1 of 2 executor(s) had no framework ledger; a pass on the 1 verified is withheld"
    run = reconcile(RunInput((ex([entry(100, 50)], [resp(100, 50)], "a"), ex([], [resp(100, 50)], "b"),
                              ex([entry(100, 50)], [], "c"))))
    assert run.coverage_note == ("1 of 3 executor(s) had no chat-boundary truth and 1 no framework ledger; "
                                 "a pass on the 1 verified is withheld")
    # MAF Python without the instrumentation, on the Path-2 gap: no ledger, and no truth either (the
    # reason says what is missing first); it is counted as lacking truth, as AgentEval words it
    run = reconcile(RunInput((ex([entry(100, 50)], [resp(100, 50)], "a"), ex([], [req()], "b", derived=True))))
    assert run.executors[1].no_truth_reason is NoTruthReason.RESPONSE_MISSING
    assert run.coverage_note == "1 of 2 executor(s) had no chat-boundary truth; a pass on the 1 verified is withheld"


def test_each_figure_of_a_units_evidence_is_under_its_own_name():
    """The reconciler builds a unit's evidence positionally (per unit of every run): every figure
    lands in its own field, each checked here with a value no other field has."""
    record = ExecutorRecord(
        "writer",
        ledger=(LedgerEntry(Usage(10, 20), "stop", 1, "inv", "l1"),),
        turns=(ChatTurn(Usage(100, 200, None, 5, 6, 7), "length", 2, "inv", "c1", None, "gpt-4o", "openai"),
               ChatTurn(Usage(), None, 3, "inv", "c2", "429 Too Many Requests", "gpt-4o", "openai")),
        ledger_source="AgentResponseEvent", span_ids=("e1", "e2"), stacked_chat_spans=3)
    verdict = reconcile_executor(record, Policy(tolerance=0.03))
    ev = verdict.evidence
    assert (verdict.executor_id, verdict.verdict, verdict.score) == ("writer", Verdict.BOTH, 0.0)
    assert (verdict.token_diverged, verdict.finish_diverged, verdict.no_truth_reason) == (True, True, None)
    assert (ev.framework_tokens, ev.truth_tokens, ev.delta, ev.direction, ev.tolerance) == (30, 300, -270, "under",
                                                                                            0.03)
    assert (ev.framework_finish, ev.truth_finish, ev.aligned, ev.ledger_source) == ("stop", "length", True,
                                                                                    "AgentResponseEvent")
    assert [(c.invocation, c.framework, c.truth, c.diverged) for c in ev.finish_comparisons] == [
        ("inv", "stop", "length", True)]
    assert (ev.ledger_missing, ev.ledger_entries, ev.response_turns, ev.request_turns, ev.failed_turns) == (
        False, 1, 1, 0, 1)
    assert (ev.ledger_span_ids, ev.chat_span_ids, ev.executor_span_ids) == (("l1",), ("c1", "c2"), ("e1", "e2"))
    assert ev.chat_calls == record.turns and ev.ledger == record.ledger
    assert (ev.framework_input_tokens, ev.framework_output_tokens, ev.truth_input_tokens, ev.truth_output_tokens,
            ev.truth_cache_read_tokens, ev.truth_cache_write_tokens, ev.truth_reasoning_tokens) == (
        10, 20, 100, 200, 5, 6, 7)
    assert (ev.stacked_chat_spans, ev.chat_layers_disagree, ev.cost) == (3, (), None)


@pytest.mark.parametrize(
    "score,unchecked,status",
    [
        (1.0, 0, Status.PASS), (0.99, 0, Status.PASS), (0.9899, 0, Status.WARN), (0.80, 0, Status.WARN),
        (0.7999, 0, Status.FAIL), (1.0, 1, Status.WARN), (0.5, 3, Status.FAIL), (None, 2, Status.PENDING),
        (None, 0, Status.PENDING),
    ],
)
def test_status_boundaries(score, unchecked, status):
    assert run_status(score, unchecked) is status


def test_a_run_missing_spans_cannot_pass_one_only_cut_short_can():
    """Units whose spans never arrived were not checked; a run whose own span arrived but whose
    quiet period a stopping collector cut short is only flagged."""
    agree = (ex([entry(100, 0)], [resp(100, 0)], "a"), ex([entry(7, 0)], [resp(7, 0)], "b"))
    missing = reconcile(RunInput(agree, incomplete=True, partial=True))
    assert (missing.status, missing.score) == (Status.WARN, 1.0) and missing.exit_code == 10
    assert missing.coverage_note == "the trace is incomplete; a pass on the 2 unit(s) that arrived is withheld"
    cut = reconcile(RunInput(agree, incomplete=True))
    assert (cut.status, cut.coverage_note, cut.incomplete) == (Status.PASS, None, True)
    failing = reconcile(RunInput((agree[0], ex([entry(1, 0)], [resp(100, 0)], "b")), incomplete=True, partial=True))
    assert (failing.status, failing.coverage_note) == (Status.FAIL, None)  # what diverged is still a divergence


def test_pending_run_has_no_score():
    run = reconcile(RunInput((ex([entry(1, 1)], [req()], "a"), ex([entry(1, 1)], [], "b"))))
    assert run.status is Status.PENDING and run.score is None and run.exit_code == 11
    assert {e.no_truth_reason for e in run.executors} == {NoTruthReason.RESPONSE_MISSING, NoTruthReason.NO_CHAT_TRACE}


def test_run_score_is_mean_over_checked_executors():
    run = reconcile(RunInput((
        ex([entry(100, 0)], [resp(100, 0)], "a"),
        ex([entry(1, 0)], [resp(100, 0)], "b"),
        ex([entry(100, 0)], [req()], "c"),
    )))
    assert run.score == 0.75 and run.checked == 2 and run.unchecked == 1 and run.status is Status.FAIL


def test_empty_run_is_pending():
    run = reconcile(RunInput(()))
    assert run.status is Status.PENDING and run.score is None


# --- properties -------------------------------------------------------------------------------

tokens = st.one_of(st.none(), st.integers(0, 5000))
reasons = st.sampled_from([None, "stop", "length", "content_filter", "tool_calls", "STOP"])
usage = st.builds(Usage, tokens, tokens, tokens)
invocations = st.sampled_from([None, "1", "2"])


@st.composite
def records(draw, eid="e"):
    ledger = [LedgerEntry(draw(usage), draw(reasons), i, draw(invocations))
              for i in range(draw(st.integers(0, 4)))]
    turns = []
    for i in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            turns.append(ChatTurn(draw(usage), draw(reasons), i, draw(invocations)))
        else:
            turns.append(ChatTurn(Usage(), None, i, draw(invocations)))
    return ExecutorRecord(eid, tuple(ledger), tuple(turns), "test")


def _same(a, b):
    return (a.verdict, a.score, a.no_truth_reason) == (b.verdict, b.score, b.no_truth_reason)


@given(records(), st.randoms())
def test_permuting_entries_or_turns_never_changes_the_verdict(record, rnd: random.Random):
    ledger, turns = list(record.ledger), list(record.turns)
    rnd.shuffle(ledger)
    rnd.shuffle(turns)
    shuffled = ExecutorRecord(record.executor_id, tuple(ledger), tuple(turns), "test")
    assert _same(reconcile_executor(record), reconcile_executor(shuffled))


@given(records(), st.integers(1, 6), st.data())
def test_splitting_framework_tokens_over_more_entries_keeps_the_token_verdict(record, parts, data):
    total = sum(e.usage.total or 0 for e in record.ledger)
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    pieces = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    reason = next((e.finish_reason for e in record.ledger if e.finish_reason is not None), None)
    split = tuple(LedgerEntry(Usage(total_tokens=p), reason if i == 0 else None, i) for i, p in enumerate(pieces))
    merged = ExecutorRecord("e", (LedgerEntry(Usage(total_tokens=total), reason, 0),), record.turns, "test")
    a, b = reconcile_executor(merged), reconcile_executor(ExecutorRecord("e", split, record.turns, "test"))
    assert a.token_diverged == b.token_diverged
    assert a.evidence.framework_tokens == b.evidence.framework_tokens


@settings(max_examples=60)
@given(st.lists(records(), min_size=0, max_size=6))
def test_run_score_is_the_mean_over_checked_executors_only(recs):
    recs = [ExecutorRecord(f"e{i}", r.ledger, r.turns, r.ledger_source) for i, r in enumerate(recs)]
    run = reconcile(RunInput(tuple(recs)))
    scores = [e.score for e in run.executors if e.verdict is not Verdict.NO_TRUTH]
    assert run.score == (sum(scores) / len(scores) if scores else None)
    assert (run.status is Status.PENDING) == (not scores)


@settings(max_examples=60)
@given(st.lists(records(), min_size=1, max_size=4), st.integers(1, 4))
def test_adding_no_truth_executors_never_changes_the_score(recs, extra):
    recs = [ExecutorRecord(f"e{i}", r.ledger, r.turns, r.ledger_source) for i, r in enumerate(recs)]
    untruthed = [ExecutorRecord(f"n{i}", (LedgerEntry(Usage(1, 1), "stop"),), (), "test") for i in range(extra)]
    base = reconcile(RunInput(tuple(recs)))
    more = reconcile(RunInput(tuple(recs + untruthed)))
    assert base.score == more.score
    assert more.unchecked == base.unchecked + extra
