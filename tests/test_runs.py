"""Runs are workflow-run spans (docs/design.md §3 Runs): several per trace, nested ones belong to the outer
run, parents that are never exported are not waited for. Spans are made by the real SDK, encoded
to real OTLP protobuf and decoded as the receivers do; the assembler runs on a controlled clock."""

from __future__ import annotations

import random
import sys
from datetime import UTC, datetime
from pathlib import Path

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector.config import CollectorConfig
from collector.core.reconcile import reconcile
from collector.formats.decode import decode_bytes, decode_request
from collector.formats.loader import iter_runs
from collector.live.assembler import Assembler

CONFIG = CollectorConfig()
MATCHER = CONFIG.matcher()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A real SDK tracer whose finished spans are handed over in export order."""

    def __init__(self, language: str = "python") -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "app", "telemetry.sdk.language": language}))
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("agent_framework")

    def take(self, drop: set[str] = frozenset()) -> list:
        spans = [s for s in self.exporter.get_finished_spans() if s.name not in drop]
        self.exporter.clear()
        return spans

    def agent(self, executor: str, agent: str, calls: list[tuple[int, int]], reported: tuple[int, int] | None,
              agent_type: str = "AgentExecutor", ledger: bool = True, span_name: str | None = None) -> None:
        """One executor invocation running one agent: its chat calls and the response it reported."""
        t = self.tracer
        with t.start_as_current_span(f"executor.process {executor}",
                                     attributes={"executor.id": executor, "executor.type": agent_type}):
            self.agent_only(agent, calls, reported, ledger, span_name)

    def agent_only(self, agent: str, calls: list[tuple[int, int]], reported: tuple[int, int] | None,
                   ledger: bool = True, span_name: str | None = None) -> None:
        t = self.tracer
        with t.start_as_current_span(span_name or f"invoke_agent {agent}",
                                     attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent,
                                                 **(_usage(*reported) if reported and not ledger else {})}):
            for i, o in calls:
                with t.start_as_current_span("chat m", attributes={"gen_ai.operation.name": "chat", **_usage(i, o)}):
                    pass
            if ledger and reported:
                with t.start_as_current_span(f"agent_response {agent}", attributes={
                        "fidelity.ledger.source": "AgentResponseEvent", "gen_ai.agent.name": agent,
                        **_usage(*reported)}):
                    pass


def _usage(i: int, o: int, finish: str = "stop") -> dict:
    return {"gen_ai.usage.input_tokens": i, "gen_ai.usage.output_tokens": o,
            "gen_ai.response.finish_reasons": f'["{finish}"]'}


def offer(assembler: Assembler, spans: list) -> None:
    decoded = decode_request(encode_spans(spans), MATCHER)
    assembler.offer(decoded.spans)


def verdicts(finalized) -> dict[str, dict[str, str]]:
    """run id -> {unit: verdict}"""
    out = {}
    for item in finalized:
        v = reconcile(item.run)
        out[item.run.run_id] = {e.executor_id: e.verdict.value for e in v.executors}
    return out


def test_each_human_in_the_loop_turn_under_one_caller_span_is_its_own_run():
    clock, rec = Clock(), Recorder()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    with rec.tracer.start_as_current_span("chat session") as session:
        with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "review"}) as turn1:
            rec.agent("drafter", "drafter", [(400, 100)], (400, 100))
        offer(assembler, rec.take())
        turn1_arrived = clock.now
        clock.now += CONFIG.assembly.quiet_period  # the human takes their time: turn 1 is final
        first = assembler.sweep().finalized
        clock.now += 40
        with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "review"}) as turn2:
            rec.agent("drafter", "drafter", [(500, 50)], (100, 50))  # under-reported this time
            offer(assembler, rec.take())  # the turn's agent spans, exported while it runs on
            clock.now += CONFIG.assembly.quiet_period / 2
        with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "review"}):
            pass  # a turn in which no agent ran: not a run
    offer(assembler, rec.take())
    turn2_arrived = clock.now
    clock.now += CONFIG.assembly.quiet_period
    later = assembler.sweep().finalized
    # each run's verdict latency counts from its workflow-run span's arrival, as the first run's
    # does: turn 2's counted the human's 40 s too, then the turn's own run time
    assert [f.root_arrived for f in first + later] == [turn1_arrived, turn2_arrived]
    trace_id = format(session.get_span_context().trace_id, "032x")
    run1 = f"{trace_id}-{turn1.get_span_context().span_id:016x}"
    run2 = f"{trace_id}-{turn2.get_span_context().span_id:016x}"
    assert verdicts(first) == {run1: {"drafter": "Agree"}}
    assert verdicts(later) == {run2: {"drafter": "TokenMismatch"}}  # turn 1 is not re-published
    assert [f.revision for f in first + later] == [1, 1]


def test_dotnet_runs_complete_without_the_session_span_that_is_never_exported():
    clock, rec = Clock(), Recorder("dotnet")
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    with rec.tracer.start_as_current_span("workflow.session") as session:
        for _ in range(2):
            with rec.tracer.start_as_current_span("workflow_invoke", attributes={"workflow.id": "planner_1"}):
                rec.agent("planner_1", "planner", [(100, 20)], (100, 20), ledger=False,
                          agent_type="Microsoft.Agents.AI.Workflows.Specialized.AIAgentHostExecutor",
                          span_name="invoke_agent planner(1)")
    offer(assembler, rec.take(drop={"workflow.session"}))
    clock.now += CONFIG.assembly.quiet_period  # long before max_trace_wait
    finalized = assembler.sweep().finalized
    assert len(finalized) == 2
    for item in finalized:
        # .NET's workflow_invoke has no workflow name: the run is named by its service (docs/design.md §3),
        # not by workflow.id, which MAF Python fills with a per-process uuid
        assert not item.run.incomplete and item.run.subject == "app"
        (unit,) = reconcile(item.run).executors
        # an agent executor's own agent is named by the executor id; .NET's agent span is its ledger
        assert (unit.executor_id, unit.verdict.value, unit.evidence.ledger_source) == ("planner_1", "Agree",
                                                                                       "invoke_agent")
    assert format(session.get_span_context().trace_id, "032x") == finalized[0].run.trace_id


def test_a_run_still_in_progress_during_a_quiet_gap_is_not_split():
    clock, rec = Clock(), Recorder()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    with rec.tracer.start_as_current_span("caller"):
        with rec.tracer.start_as_current_span("workflow.run") as run1:
            rec.agent("a", "a", [(10, 1)], (10, 1))
        with rec.tracer.start_as_current_span("workflow.run") as run2:
            with rec.tracer.start_as_current_span("executor.process b", attributes={"executor.id": "b"}):
                with rec.tracer.start_as_current_span("invoke_agent b", attributes={"gen_ai.agent.name": "b"}):
                    with rec.tracer.start_as_current_span("chat m", attributes={"gen_ai.operation.name": "chat",
                                                                                **_usage(30, 3)}):
                        pass
                    offer(assembler, rec.take())  # run 2's first call is exported; its agent is still running
                    clock.now += CONFIG.assembly.quiet_period  # a slow model call: the trace is quiet
                    first = assembler.sweep().finalized
                    with rec.tracer.start_as_current_span("chat m", attributes={"gen_ai.operation.name": "chat",
                                                                                **_usage(40, 4)}):
                        pass
                    with rec.tracer.start_as_current_span("agent_response b", attributes={
                            "fidelity.ledger.source": "AgentResponseEvent", "gen_ai.agent.name": "b", **_usage(70, 7)}):
                        pass
    offer(assembler, rec.take())
    clock.now += CONFIG.assembly.quiet_period
    later = assembler.sweep().finalized
    trace_id = format(run1.get_span_context().trace_id, "032x")
    assert verdicts(first) == {f"{trace_id}-{run1.get_span_context().span_id:016x}": {"a": "Agree"}}
    (item,) = later
    assert item.run.run_id == f"{trace_id}-{run2.get_span_context().span_id:016x}"
    (b,) = reconcile(item.run).executors
    assert (b.executor_id, b.verdict.value, b.evidence.truth_tokens, b.evidence.response_turns) == ("b", "Agree", 77, 2)


def test_a_sub_workflow_run_span_belongs_to_its_outer_run():
    clock, rec = Clock(), Recorder()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "outer"}):
        rec.agent("intake", "intake", [(10, 1)], (10, 1))
        with rec.tracer.start_as_current_span("executor.process inner", attributes={
                "executor.id": "inner", "executor.type": "WorkflowExecutor"}):
            with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "inner-wf"}):
                rec.agent("drafter", "drafter", [(20, 2)], (20, 2))
                rec.agent("checker", "checker", [(30, 3)], (30, 3))
    offer(assembler, list(reversed(rec.take())))  # parents first this time
    clock.now += CONFIG.assembly.quiet_period
    (item,) = assembler.sweep().finalized
    assert item.run.subject == "outer" and item.run.non_agent_executors == ("inner",)
    assert {e.executor_id: e.verdict.value for e in reconcile(item.run).executors} == {
        "intake": "Agree", "drafter": "Agree", "checker": "Agree"}


def test_spans_in_a_parent_cycle_are_reconciled_not_dropped():
    from collector.core.classify import TraceState
    from collector.core.facts import SpanRecord, span_facts

    def record(sid: bytes, parent: bytes, name: str, start: int, attrs: dict) -> SpanRecord:
        return SpanRecord(tid, sid, parent, name, start, span_facts(MATCHER, name, attrs))

    tid = bytes(range(1, 17))
    state = TraceState(MATCHER, tid)
    a, b, c = (bytes([9] * 7 + [n]) for n in (1, 2, 3))
    state.add(record(a, b, "invoke_agent x", 1, {"gen_ai.agent.name": "x"}))
    state.add(record(b, a, "executor.process e", 2, {"executor.id": "e"}))
    state.add(record(c, a, "chat m", 3, {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 5,
                                         "gen_ai.usage.output_tokens": 1}))
    state.add(record(c[:7] + b"\x04", c[:7] + b"\x04", "chat m", 4, {"gen_ai.operation.name": "chat"}))
    (run, _), = state.run_inputs(everything=True)
    (x,) = run.executors
    assert (x.executor_id, len(x.turns), x.turns[0].usage.total) == ("x", 1, 6)  # the cycle's chat call
    # the self-parented chat span: noted, not dropped
    assert [(u.executor, u.calls) for u in run.unattributed_chat] == [(None, 1)]


def test_the_late_window_is_bounded_in_bytes_not_only_in_traces():
    from collector.live.assembler import LATE_BYTES_PER_SPAN

    clock, rec = Clock(), Recorder()
    config = CONFIG.assembly.model_copy(update={"max_late_bytes": 300 * LATE_BYTES_PER_SPAN})
    assembler = Assembler(config, MATCHER, clock)
    for _ in range(4):  # four finalized traces of ~130 spans each: more than 300 spans' worth
        with rec.tracer.start_as_current_span("workflow.run"):
            for i in range(8):
                rec.agent(f"agent-{i}", f"agent-{i}", [(10, 1)] * 12, (120, 12))
        offer(assembler, rec.take())
        clock.now += CONFIG.assembly.quiet_period
        assembler.sweep()
    assert assembler.late_traces == 2 and assembler.late_bytes <= config.max_late_bytes  # oldest left first



def test_the_next_sweep_is_due_when_the_earliest_quiet_period_ends():
    clock, rec = Clock(), Recorder()
    quiet, cap = CONFIG.assembly.quiet_period, CONFIG.assembly.sweep_interval
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    assert assembler.next_deadline(clock.now) == clock.now + cap  # nothing open: only the cap
    with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "a"}):
        rec.agent("writer", "writer", [(400, 100)], (400, 100))
    offer(assembler, rec.take())
    started = clock.now
    clock.now += quiet / 2
    with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "b"}):
        rec.agent("editor", "editor", [(40, 10)], (40, 10))
    offer(assembler, rec.take())
    assert assembler.next_deadline(clock.now) == min(started + quiet, clock.now + cap)
    clock.now = started + quiet
    assert len(assembler.sweep().finalized) == 1  # at that deadline exactly, the first trace completes
    assert assembler.next_deadline(clock.now) == min(started + quiet / 2 + quiet, clock.now + cap)


def test_a_trace_that_became_due_during_a_sweep_is_swept_at_once():
    """Found by bench/latency.py: a complete trace due just after a sweep waited the whole cap."""
    clock, rec = Clock(), Recorder()
    quiet = CONFIG.assembly.quiet_period
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    for name, delay in (("a", 0.0), ("b", 0.1)):
        clock.now += delay
        with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": name}):
            rec.agent("writer", "writer", [(400, 100)], (400, 100))
        offer(assembler, rec.take())
    start_b = clock.now
    clock.now = start_b - 0.1 + quiet + 0.05  # a is due, b not yet
    assert len(assembler.sweep().finalized) == 1
    clock.now = start_b + quiet + 0.01  # b became due after that sweep
    assert assembler.next_deadline(clock.now) == clock.now
    assert len(assembler.sweep().finalized) == 1



def test_an_incomplete_run_says_why_in_its_notes():
    """A run flagged incomplete carries the cause, never a cause that did not happen: the collector
    stopping during the quiet period (the workflow-run span had arrived), and a trace whose root
    span never arrived."""
    notes = {}
    for case in ("shutdown", "no root"):
        clock, rec = Clock(), Recorder()
        assembler = Assembler(CONFIG.assembly, MATCHER, clock)
        with rec.tracer.start_as_current_span("caller"), rec.tracer.start_as_current_span("workflow.run"):
            rec.agent("a", "a", [(10, 1)], (10, 1))
        drop = {"shutdown": set(), "no root": {"caller", "workflow.run"}}[case]
        offer(assembler, rec.take(drop))
        if case == "shutdown":
            (item,) = assembler.drain().finalized  # before the quiet period ends
        else:
            assert assembler.sweep().finalized == []
            clock.now += CONFIG.assembly.max_trace_wait
            (item,) = assembler.sweep().finalized
        assert item.run.incomplete and reconcile(item.run).notes == item.run.notes
        notes[case] = item.run.notes
    assert notes == {
        "shutdown": ("Trace incomplete: the collector stopped before the trace's quiet period ended; spans that "
                     "had not arrived are not in this verdict.",),
        "no root": ("Trace incomplete: its root span never arrived; spans that had not arrived are not in this "
                    "verdict.",),
    }
    clock, rec = Clock(), Recorder()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    with rec.tracer.start_as_current_span("workflow.run"):
        rec.agent("a", "a", [(10, 1)], (10, 1))
    offer(assembler, rec.take())
    clock.now += CONFIG.assembly.quiet_period
    (item,) = assembler.sweep().finalized
    assert not item.run.incomplete and item.run.notes == ()


def test_a_run_whose_spans_lost_their_parent_cannot_pass():
    """A workflow-run span lost (an exporter's queue dropped it, a crash) under a root that did
    arrive: its agents' spans are classified as if parentless, and units may be missing, so the run
    is incomplete and withheld from passing (it was a plain PASS: nothing looked missing)."""
    import dataclasses

    from collector.core.classify import TraceState
    from collector.core.facts import span_facts
    from collector.core.model import Status

    from mafshape import SCENARIOS, export_request, record
    spans, _ = record([SCENARIOS["pass"][0]])
    records = decode_request(export_request(spans), MATCHER).spans
    workflow = next(s for s in records if s.name.startswith("workflow"))
    root = dataclasses.replace(workflow, span_id=b"\x55" * 8, parent_id=b"", name="POST /chat",
                               facts=span_facts(MATCHER, "POST /chat", {}))
    state = TraceState(MATCHER, workflow.trace_id)
    for span in [root] + [s for s in records if s is not workflow]:
        state.add(span)
    ((run, revision),) = state.run_inputs()
    verdict = reconcile(run, revision=revision)
    assert run.partial and run.incomplete and "never got their parent span" in run.notes[0]
    assert (verdict.status, verdict.score) == (Status.WARN, 1.0)
    assert {e.executor_id: e.verdict.value for e in verdict.executors} == {"researcher": "Agree", "writer": "Agree"}


# --- delivery order (docs/design.md §3 Assembly): the verdict does not depend on it ------------------------

def _pipeline_spans() -> tuple[list, str]:
    """A workflow run of two agents, the second one's executor span exported late (its children
    first): what an exporter in another process, or a kill -9 recovery, delivers."""
    rec = Recorder()
    with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "ordered"}) as root:
        rec.agent("researcher", "researcher", [(420, 180)], (420, 180))
        rec.agent("writer", "writer", [(300, 40), (610, 350)], (910, 390))
    spans = rec.take()
    return spans, f"{root.get_span_context().trace_id:032x}-{root.get_span_context().span_id:016x}"


def _in_order_verdict(spans: list) -> dict:
    clock = Clock()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    offer(assembler, spans)
    clock.now += CONFIG.assembly.quiet_period
    (item,) = assembler.sweep().finalized
    return _summary(reconcile(item.run, revision=item.revision))


def _summary(verdict) -> dict:
    return {"status": verdict.status.value, "incomplete": verdict.incomplete,
            "units": {e.executor_id: (e.verdict.value, e.evidence.framework_tokens, e.evidence.truth_tokens)
                      for e in verdict.executors}}


def test_a_parent_arriving_after_its_trace_was_finalized_gives_the_in_order_verdict():
    spans, run_id = _pipeline_spans()
    expected = _in_order_verdict(spans)
    assert expected == {"status": "PASS", "incomplete": False,
                        "units": {"researcher": ("Agree", 600, 600), "writer": ("Agree", 1300, 1300)}}
    late = next(s for s in spans if s.name == "executor.process writer")
    root = next(s for s in spans if s.name == "workflow.run")
    children = [s for s in spans if s is not late and s is not root]
    clock = Clock()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    offer(assembler, children)  # the writer's agent, chat and ledger spans wait for their executor span
    offer(assembler, [root])
    clock.now += CONFIG.assembly.quiet_period
    (first,) = [i for i in assembler.sweep().finalized if i.run.run_id == run_id]
    assert _summary(reconcile(first.run))["status"] != "PASS"  # units are missing: never a pass
    clock.now += CONFIG.assembly.quiet_period  # the parent comes later than the quiet period
    offer(assembler, [late])
    clock.now += CONFIG.assembly.quiet_period
    (item,) = [i for i in assembler.sweep().finalized if i.run.run_id == run_id]
    assert item.revision == 2
    assert _summary(reconcile(item.run, revision=item.revision)) == expected


def test_a_parent_cycle_through_the_root_is_reconciled_at_the_quiet_period_not_the_late_window():
    rec = Recorder()
    with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": "cyclic"}):
        rec.agent("writer", "writer", [(300, 40)], (300, 40))
    spans = rec.take()
    root = next(s for s in spans if s.name == "workflow.run")
    executor = next(s for s in spans if s.name == "executor.process writer")
    # the root names its own executor span as parent: a cycle through the root, no parentless span
    root._parent = executor.get_span_context()
    clock = Clock()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    offer(assembler, spans)
    clock.now += CONFIG.assembly.quiet_period
    (item,) = assembler.sweep().finalized  # at once: nothing outside a cycle can ever resolve it
    assert {e.executor_id: e.verdict.value for e in reconcile(item.run).executors} == {"writer": "Agree"}


def _workload():
    """bench/workload.py, the module the benches share."""
    bench = str(Path(__file__).parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import workload

    return workload


def _bench_runs(traces: int) -> list:
    """The runs of ``traces`` bench workload traces, finalized."""
    workload = _workload()
    clock = Clock()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    for body in workload.encode([workload.trace_spans(random.Random(seed)) for seed in range(traces)]):
        assembler.offer(decode_bytes(body, MATCHER).spans)
    clock.now += CONFIG.assembly.max_trace_wait + 1
    return [item.run for item in assembler.sweep().finalized]


def test_the_bench_workload_traces_pass():
    """The benches measure the collector on passing runs: a workload trace reconciles as PASS (its
    ledger's finish reasons were once written as the text "['stop']", a FinishMismatch)."""
    runs = _bench_runs(5)
    assert len(runs) == 5
    for run in runs:
        result = reconcile(run)
        assert {e.verdict.value for e in result.executors} == {"Agree"} and result.status.value == "PASS"


def test_the_benches_read_the_documents_the_store_writes(tmp_path):
    """bench/overload.py and bench/soak.py read stored runs through workload.stored_docs: it reads
    what this collector's store writes (zstd since issue 39), as it did zlib before."""
    import sqlite3

    from collector.store import StoredRun, open_store

    verdicts = {run.trace_id: reconcile(run) for run in _bench_runs(3)}
    store = open_store(str(tmp_path / "runs.db"))
    store.save_many([StoredRun(f"run-{i}", "live", v) for i, v in enumerate(verdicts.values())])
    store.close()
    docs = dict(_workload().stored_docs(sqlite3.connect(tmp_path / "runs.db")))
    assert sorted(docs) == sorted(verdicts)
    for trace_id, doc in docs.items():
        assert doc["status"] == "PASS"
        assert ([(e["executor_id"], e["verdict"], e["evidence"]["truth_tokens"]) for e in doc["executors"]]
                == [(e.executor_id, e.verdict.value, e.evidence.truth_tokens) for e in verdicts[trace_id].executors])


def test_a_run_starts_with_its_workflow_run_span_and_lasts_until_its_last_span_ends():
    """When a run started is its workflow-run span's start, even where a span timed by another
    process's clock starts earlier; how long it took runs to the latest end of its spans (one ending
    after the workflow-run span included), not of the caller's span around it. A run without a
    workflow-run span (a direct agent call) starts with its earliest span. A file without times
    (workflow-trace/v1) says neither (null)."""

    clock, rec = Clock(), Recorder()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    base = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z, in ns
    ms = 1_000_000

    def span(name: str, parent, start: int, end: int, attrs: dict | None = None):
        made = rec.tracer.start_span(name, context=trace.set_span_in_context(parent) if parent else None,
                                     attributes=attrs, start_time=base + start * ms)
        made.end(end_time=base + end * ms)
        return made

    # a caller's span around the workflow run; an executor starting 500 ms "before" its run; a chat call ending after it
    caller = rec.tracer.start_span("session", start_time=base)
    run = span("workflow.run", caller, 1_000, 5_000, {"workflow.name": "timed"})
    executor = span("executor.process w", run, 500, 4_000, {"executor.id": "w", "executor.type": "AgentExecutor"})
    agent = span("invoke_agent w", executor, 600, 3_900, {"gen_ai.operation.name": "invoke_agent",
                                                          "gen_ai.agent.name": "w"})
    span("chat m", agent, 700, 7_250, {"gen_ai.operation.name": "chat", **_usage(10, 1)})
    span("agent_response w", agent, 3_800, 3_850, {"fidelity.ledger.source": "AgentResponseEvent",
                                                   "gen_ai.agent.name": "w", **_usage(10, 1)})
    caller.end(end_time=base + 100_000 * ms)
    # a direct agent call: its chat span starts 250 ms before the agent span (another clock)
    direct = span("invoke_agent solo", None, 20_000, 21_000, {"gen_ai.operation.name": "invoke_agent",
                                                               "gen_ai.agent.name": "solo"})
    span("chat m", direct, 19_750, 20_900, {"gen_ai.operation.name": "chat", **_usage(5, 1)})
    offer(assembler, rec.take())
    clock.now += CONFIG.assembly.quiet_period
    verdicts_by_subject = {v.subject: v for v in (reconcile(item.run) for item in assembler.sweep().finalized)}
    timed, solo = verdicts_by_subject["timed"], verdicts_by_subject["app"]
    assert datetime.fromisoformat(timed.started_at) == datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC)
    assert timed.duration_s == 6.25
    assert datetime.fromisoformat(solo.started_at) == datetime(2026, 1, 1, 0, 0, 19, 750_000, tzinfo=UTC)
    assert solo.duration_s == 1.25
    (v1,) = iter_runs(Path(__file__).parents[1] / "examples" / "pass_all_agree.json", MATCHER)
    assert (reconcile(v1).started_at, reconcile(v1).duration_s) == (None, None)
