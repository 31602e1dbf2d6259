"""Which run a ledger span belongs to (docs/verdicts.md "Which run a ledger belongs to"): by identity,
never by time. MAF .NET's workflow events reach the ledger package at the caller, after the run's own
spans ended: the package's ledger span given the run (``WithFidelityLedger(run)``) sits under the
executor span that produced the response; one written without it (an older package, the seed's
hand-built traces) sits beside the runs under the caller's span and names only its executor, and joins
a run only where exactly one could own it. Spans are made by the real SDK, encoded to real OTLP
protobuf and decoded as the receivers do; the assembler runs on a controlled clock."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span

from collector.core.reconcile import reconcile
from collector.live.assembler import Assembler

from test_runs import CONFIG, MATCHER, Clock, Recorder, _usage, offer

HOST = "Microsoft.Agents.AI.Workflows.Specialized.AIAgentHostExecutor"
LEDGER = {"fidelity.ledger.source": "AgentResponseEvent"}


def executor_id(name: str, instance: str = "3f" * 16) -> str:
    """MAF .NET's id of an agent's host executor: ``{Name}_{Id}``, the Id the agent instance's uuid."""
    return f"{name}_{instance}"


class DotnetApp:
    """Spans as a MAF .NET app with the ledger package sends them: the caller's span, each run's
    ``workflow.session`` and ``invoke_workflow``, agent executors running agents whose
    ``invoke_agent`` span sees the response inside the middleware (the truth), and the response the
    caller got (after the middleware) as a ledger span written when the caller read the event."""

    def __init__(self) -> None:
        self.rec = Recorder(language="dotnet")
        self.tracer = self.rec.tracer
        self.events: list[tuple[trace.Context, str, tuple[int, int]]] = []

    @contextmanager
    def session(self) -> Iterator[None]:
        with self.tracer.start_as_current_span("workflow.session"):
            yield

    def turn(self, agents: dict[str, tuple[tuple[int, int], tuple[int, int]]], decorator: bool = False,
             instance: str = "3f" * 16) -> Span:
        """One ``invoke_workflow``: per agent (truth, reported). Its events are read after it ended."""
        with self.tracer.start_as_current_span("invoke_workflow", attributes={
                "gen_ai.operation.name": "invoke_workflow"}) as run:
            for agent, (truth, reported) in agents.items():
                executor = executor_id(agent, instance)
                with self.tracer.start_as_current_span(f"executor.process {executor}", attributes={
                        "executor.id": executor, "executor.type": HOST}) as host:
                    with self.tracer.start_as_current_span(f"invoke_agent {agent}({'3f' * 16})", attributes={
                            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent, **_usage(*truth)}):
                        with self.tracer.start_as_current_span("chat gpt-4o-mini", attributes={
                                "gen_ai.operation.name": "chat", **_usage(*truth)}):
                            pass
                        if decorator:  # UseFidelityLedger() inside the lying middleware: sees the truth
                            with self.tracer.start_as_current_span(f"agent_response {agent}", attributes={
                                    **LEDGER, "gen_ai.agent.name": agent, **_usage(*truth)}):
                                pass
                self.events.append((trace.set_span_in_context(host), executor, reported))
        return run

    def read_events(self, parent: trace.Context | None) -> None:
        """The caller reads the run's events: each AgentResponseEvent becomes a ledger span under the
        executor span that produced it (``parent`` None: WithFidelityLedger(run)) or under ``parent``
        (WithFidelityLedger() without the run: no identity of its run)."""
        for host, executor, reported in self.events:
            with self.tracer.start_as_current_span(f"agent_response {executor}", context=parent or host,
                                                   attributes={**LEDGER, "executor.id": executor, **_usage(*reported)}):
                pass
        self.events.clear()


def run_id(span: Span) -> str:
    context = span.get_span_context()
    return f"{context.trace_id:032x}-{context.span_id:016x}"


def units(finalized) -> dict[str, dict[str, tuple]]:
    """run id -> unit -> (verdict, framework tokens, truth tokens, NoTruth reason), the last revision of each."""
    out: dict[str, dict[str, tuple]] = {}
    for item in finalized:
        verdict = reconcile(item.run)
        out[item.run.run_id] = {e.executor_id: (e.verdict.value, e.evidence.framework_tokens, e.evidence.truth_tokens,
                                                e.no_truth_reason.value if e.no_truth_reason else None)
                                for e in verdict.executors}
    return out


def deliver(spans: list, batches: int, seed: int) -> list:
    """``spans`` in a shuffled order, cut into ``batches`` exports, each swept once quiet: every
    revision the collector published."""
    clock = Clock()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    spans = list(spans)
    random.Random(seed).shuffle(spans)
    published = []
    size = -(-len(spans) // batches)
    for start in range(0, len(spans), size):
        offer(assembler, spans[start:start + size])
        clock.now += CONFIG.assembly.quiet_period
        published += assembler.sweep().finalized
    clock.now += CONFIG.assembly.max_trace_wait
    return published + assembler.sweep().finalized


HONEST, HALVED = ((400, 100), (400, 100)), ((500, 50), (250, 25))


def test_each_run_under_one_caller_span_is_judged_on_the_ledger_recorded_in_it_in_any_arrival_order():
    """Three runs under one caller span: two turns of one session, then a second session, the same
    executor in each, the middle one under-reporting. The ledger package given the run records each
    response under its executor's span, after the run ended: each run gets its own, delivered whole
    or shuffled into batches, and no revision ever published passes the lying turn."""
    app = DotnetApp()
    with app.tracer.start_as_current_span("write a note"):
        with app.session():
            first = app.turn({"drafter": HONEST})
            app.read_events(None)
            second = app.turn({"drafter": HALVED})
            app.read_events(None)
        with app.session():
            third = app.turn({"drafter": HONEST})
            app.read_events(None)
    spans = app.rec.take()
    expected = {run_id(first): {"drafter": ("Agree", 500, 500, None)},
                run_id(second): {"drafter": ("TokenMismatch", 275, 550, None)},
                run_id(third): {"drafter": ("Agree", 500, 500, None)}}
    for batches, seed in itertools.product((1, 2, 3, 5), range(3)):
        published = deliver(spans, batches, seed)
        assert units(published) == expected, (batches, seed)
        lying = [units([item])[run_id(second)]["drafter"][0] for item in published if item.run.run_id == run_id(second)]
        assert "Agree" not in lying, (batches, seed)


def test_a_ledger_without_its_runs_identity_beside_several_runs_is_never_guessed():
    """WithFidelityLedger() without the run (or an older package): the ledger spans sit under the
    caller's span beside two turns of one executor, written after both ended. Which turn each belongs to
    cannot be told: both units are NoTruth ledger_unjoined (never Agree on MAF's invoke_agent span, which
    sees the response inside the lying middleware), neither run passes, and no run is made of the ledger."""
    app = DotnetApp()
    with app.tracer.start_as_current_span("write a note") as caller:
        with app.session():
            first = app.turn({"drafter": HONEST})
            second = app.turn({"drafter": HALVED})
        app.read_events(trace.set_span_in_context(caller))
    spans = app.rec.take()
    for batches, seed in itertools.product((1, 3), range(2)):
        published = deliver(spans, batches, seed)
        assert units(published) == {
            run_id(first): {"drafter": ("NoTruth", 500, 500, "ledger_unjoined")},
            run_id(second): {"drafter": ("NoTruth", 550, 550, "ledger_unjoined")},
        }, (batches, seed)
        assert {item.run.run_id for item in published} == {run_id(first), run_id(second)}
        final = {item.run.run_id: reconcile(item.run) for item in published}
        assert {v.status.value for v in final.values()} == {"PENDING"}  # nothing could be checked
        (unit,) = final[run_id(second)].executors
        assert unit.evidence.ledger_unjoined == 2


def test_a_ledger_without_identity_beside_one_run_joins_it_even_when_it_arrives_first():
    """One run under the caller's span: the ledger span written beside it joins it, arrival order and
    batches aside (the ledger first in an export of its own, the run a quiet period later)."""
    app = DotnetApp()
    with app.tracer.start_as_current_span("write a note") as caller:
        with app.session():
            only = app.turn({"drafter": HALVED})
        app.read_events(trace.set_span_in_context(caller))
    spans = app.rec.take()
    ledger_first = sorted(spans, key=lambda s: not s.name.startswith("agent_response"))
    clock = Clock()
    assembler = Assembler(CONFIG.assembly, MATCHER, clock)
    published = []
    for part in (ledger_first[:1], ledger_first[1:]):
        offer(assembler, part)
        clock.now += CONFIG.assembly.quiet_period
        published += assembler.sweep().finalized
    assert units(published) == {run_id(only): {"drafter": ("TokenMismatch", 275, 550, None)}}
    for batches, seed in itertools.product((1, 2, 4), range(3)):
        assert units(deliver(spans, batches, seed)) == {run_id(only): {"drafter": ("TokenMismatch", 275, 550, None)}}


def test_a_ledger_naming_an_executor_no_run_ran_makes_no_run_of_its_own():
    app = DotnetApp()
    with app.tracer.start_as_current_span("write a note") as caller:
        with app.session():
            only = app.turn({"drafter": HONEST})
        app.read_events(trace.set_span_in_context(caller))
        with app.tracer.start_as_current_span(f"agent_response {executor_id('ghost')}", attributes={
                **LEDGER, "executor.id": executor_id("ghost"), **_usage(10, 5)}):
            pass
    (item,) = deliver(app.rec.take(), 1, 0)
    verdict = reconcile(item.run)
    assert (item.run.run_id, verdict.status.value) == (run_id(only), "PASS")
    assert any("ghost" in note and "no run" in note for note in verdict.notes), verdict.notes


def test_an_agent_recorded_both_ways_is_counted_once_and_says_so():
    """The agent decorator (UseFidelityLedger) and the workflow's events record the same response: the
    unit counts it once, the workflow's event (what the executor got, outside every middleware), and
    says the other was a second record; an under-report is not hidden by the doubled ledger."""
    for agents, want in (({"drafter": HONEST}, ("Agree", 500, 500)),
                         ({"drafter": HALVED}, ("TokenMismatch", 275, 550))):
        app = DotnetApp()
        with app.tracer.start_as_current_span("write a note"), app.session():
            run = app.turn(agents, decorator=True)
            app.read_events(None)
        (item,) = deliver(app.rec.take(), 1, 0)
        (unit,) = reconcile(item.run).executors
        assert (item.run.run_id, unit.executor_id) == (run_id(run), "drafter")
        assert (unit.verdict.value, unit.evidence.framework_tokens, unit.evidence.truth_tokens) == want
        assert (unit.evidence.ledger_entries, unit.evidence.ledger_duplicates) == (1, 1)


def test_a_workflow_run_as_an_agent_is_judged_by_its_inner_agents():
    """workflow.AsAIAgent() bound as an executor of an outer workflow: the inner workflow's run span
    sits inside the outer executor's span. Its inner agents are the units (their ledger from the
    decorator); the outer executor, whose own ledger is the sum of theirs with no chat call of its own,
    is listed beside the run, never a NoTruth unit: an honest run passes, an inner lie is caught where
    it happened."""
    for writer, status in ((HONEST, "PASS"), (HALVED, "FAIL")):
        app = DotnetApp()
        tracer = app.tracer
        with tracer.start_as_current_span("write a note"):
            with app.session():
                with tracer.start_as_current_span("invoke_workflow", attributes={
                        "gen_ai.operation.name": "invoke_workflow"}):
                    pipeline = executor_id("pipeline")
                    with tracer.start_as_current_span(f"executor.process {pipeline}", attributes={
                            "executor.id": pipeline, "executor.type": HOST}) as host:
                        with tracer.start_as_current_span("invoke_agent pipeline", attributes={
                                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "pipeline"}):
                            # the inner workflow, one run span a step as MAF's WorkflowAgent runs it
                            for agent, (truth, reported) in (("researcher", ((120, 40), (120, 40))),
                                                             ("writer", writer)):
                                with tracer.start_as_current_span("invoke_workflow", attributes={
                                        "gen_ai.operation.name": "invoke_workflow"}):
                                    with tracer.start_as_current_span(f"executor.process {executor_id(agent)}",
                                                                      attributes={"executor.id": executor_id(agent),
                                                                                  "executor.type": HOST}):
                                        with tracer.start_as_current_span(f"invoke_agent {agent}", attributes={
                                                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}):
                                            with tracer.start_as_current_span("chat gpt-4o-mini", attributes={
                                                    "gen_ai.operation.name": "chat", **_usage(*truth)}):
                                                pass
                                            with tracer.start_as_current_span(f"agent_response {agent}", attributes={
                                                    **LEDGER, "gen_ai.agent.name": agent, **_usage(*reported)}):
                                                pass
                    total = (160 + sum(writer[1]))
                with tracer.start_as_current_span(f"agent_response {pipeline}", context=trace.set_span_in_context(host),
                                                  attributes={**LEDGER, "executor.id": pipeline,
                                                              "gen_ai.usage.input_tokens": total,
                                                              "gen_ai.usage.output_tokens": 0}):
                    pass
        (item,) = deliver(app.rec.take(), 1, 0)
        verdict = reconcile(item.run)
        assert {e.executor_id: e.verdict.value for e in verdict.executors} == {
            "researcher": "Agree", "writer": "Agree" if writer is HONEST else "TokenMismatch"}
        assert verdict.status.value == status
        assert "pipeline" in verdict.non_agent_executors


def test_a_ledger_without_identity_joins_the_run_of_its_own_agent_instance():
    """Two workflows built from one definition, each with its own agents, run under one caller span and
    read without their runs: MAF .NET names each agent's executor by the agent instance's id
    ({Name}_{Id}), which the ledger span names too, so each joins its own run, the lie its own."""
    app = DotnetApp()
    with app.tracer.start_as_current_span("write a note") as caller:
        runs = []
        for instance, agents in (("0a" * 16, {"drafter": HONEST}), ("0b" * 16, {"drafter": HALVED})):
            with app.session():
                runs.append(app.turn(agents, instance=instance))
        app.read_events(trace.set_span_in_context(caller))
    assert units(deliver(app.rec.take(), 1, 0)) == {
        run_id(runs[0]): {"drafter": ("Agree", 500, 500, None)},
        run_id(runs[1]): {"drafter": ("TokenMismatch", 275, 550, None)},
    }


def _unnamed_agents(app: DotnetApp, reported: list[tuple[int, int]], ledger_name: str | None) -> None:
    """Three agents without a name run one after another with no workflow spans (a .NET builder's
    workflow): MAF's agent span knows each by its per-process id only; the ledger's decorator records
    each response under it, named ``ledger_name`` (an older package: the class) or by the id."""
    for n, (i, o) in enumerate(reported, 1):
        agent_id = f"{n:02d}" * 16
        with app.tracer.start_as_current_span(f"invoke_agent {agent_id}", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.id": agent_id, **_usage(100 * n, 10 * n)}):
            with app.tracer.start_as_current_span("chat gpt-4o-mini", attributes={
                    "gen_ai.operation.name": "chat", **_usage(100 * n, 10 * n)}):
                pass
            with app.tracer.start_as_current_span(f"agent_response {ledger_name or agent_id}", attributes={
                    **LEDGER, **({"fidelity.agent.name": ledger_name} if ledger_name else {}),
                    "gen_ai.agent.id": agent_id, **_usage(i, o)}):
                pass


def test_agents_without_a_name_are_one_unit_each_their_ledger_beside_their_truth():
    """Each unnamed agent is its own unit, unnamed-agent-1, -2, -3 in the order the run ran them, its
    ledger (under its own agent span, whatever it is called) compared with its own chat calls: the
    second agent's under-report is caught, never diluted into a shared total nor left on a NoTruth unit."""
    for ledger_name in ("ChatClientAgent", None):
        app = DotnetApp()
        with app.tracer.start_as_current_span("sequential"):
            _unnamed_agents(app, [(100, 10), (100, 10), (300, 30)], ledger_name)
        (item,) = deliver(app.rec.take(), 1, 0)
        assert units([item]) == {item.run.run_id: {
            "unnamed-agent-1": ("Agree", 110, 110, None),
            "unnamed-agent-2": ("TokenMismatch", 110, 220, None),
            "unnamed-agent-3": ("Agree", 330, 330, None),
        }}, ledger_name
