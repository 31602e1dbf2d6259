"""Every common MAF Python workflow pattern, built with the real builders on scripted chat clients.

Each :class:`Pattern` builds a real agent-framework-core 1.23 / agent-framework-orchestrations 1.4
workflow (or agent) whose agents run on the scripted clients of :mod:`collector.demo.maf_fakes`, and knows,
per agent, what the chat boundary will see (:class:`AgentFacts`: the executor it runs under, its chat
calls, their summed usage and the last finish reason), derived from the scripts. :func:`drive` runs a
pattern to completion, plain or streaming, answering human-in-the-loop requests, and never raises.

``build(overrides)`` takes per-agent :class:`AgentSpec` field overrides, so a test can inject a
divergence into any one agent, e.g. ``{"writer": {"middleware": [keep_last_call_usage()]}}``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Never

from agent_framework import (
    Agent,
    AgentExecutorResponse,
    AgentResponse,
    Content,
    Workflow,
    WorkflowBuilder,
    WorkflowContext,
    WorkflowExecutor,
    executor,
)
from agent_framework_orchestrations import (
    AgentRequestInfoResponse,
    ConcurrentBuilder,
    GroupChatBuilder,
    GroupChatState,
    HandoffAgentUserRequest,
    HandoffBuilder,
    MagenticBuilder,
    SequentialBuilder,
)

from collector.demo.maf_fakes import (
    AgentSpec,
    InstrumentedChatClient,
    Turn,
    UninstrumentedChatClient,
    lookup,
)

TASK = "Write a short report."


# region scripted turns with text and tool arguments


@dataclass(frozen=True)
class Say(Turn):
    """A :class:`Turn` whose reply text, or tool-call arguments, are scripted too (what structured-output
    parsers such as the group chat manager and Magentic's ledgers need, or a tool with other parameters)."""

    text: str | None = None
    arguments: Mapping[str, Any] | None = None


def _contents(turn: Turn) -> list[Content]:
    if turn.tool_call:
        arguments = getattr(turn, "arguments", None)
        return [Content.from_function_call(f"call-{turn.tool_call}", turn.tool_call,
                                           arguments=dict(arguments) if arguments is not None else {"query": "x"})]
    return [Content.from_text(getattr(turn, "text", None) or "ok")]


class TextInstrumentedChatClient(InstrumentedChatClient):
    """:class:`InstrumentedChatClient` playing :class:`Say` turns (plain :class:`Turn`s as before)."""

    _contents = staticmethod(_contents)


class TextUninstrumentedChatClient(UninstrumentedChatClient):
    _contents = staticmethod(_contents)


def agent(spec: AgentSpec, **agent_kwargs: Any) -> Agent:
    """``maf_fakes.make_agent`` with a client that also plays :class:`Say` turns; ``agent_kwargs`` go to
    :class:`Agent` (e.g. ``require_per_service_call_history_persistence`` for handoff participants)."""
    client_cls = TextInstrumentedChatClient if spec.instrumented else TextUninstrumentedChatClient
    return Agent(client_cls(turns=spec.turns), name=spec.name, instructions=f"You are {spec.name}.",
                 middleware=list(spec.middleware), tools=list(spec.tools) or None, **agent_kwargs)


def _json(**fields: Any) -> str:
    return json.dumps(fields)


def _ledger(next_speaker: str, *, satisfied: bool = False, instruction: str = "Go on.") -> str:
    """A Magentic progress ledger as StandardMagenticManager parses it."""
    return _json(is_request_satisfied={"reason": "scripted", "answer": satisfied},
                 is_in_loop={"reason": "scripted", "answer": False},
                 is_progress_being_made={"reason": "scripted", "answer": True},
                 next_speaker={"reason": "scripted", "answer": next_speaker},
                 instruction_or_question={"reason": "scripted", "answer": instruction})


def _pick(next_speaker: str | None, *, terminate: bool = False) -> str:
    """The group chat manager's structured output (``AgentOrchestrationOutput``)."""
    return _json(terminate=terminate, reason="scripted", next_speaker=next_speaker,
                 final_message="All done." if terminate else None)


# endregion

# region facts and patterns


@dataclass(frozen=True)
class AgentFacts:
    """What the chat boundary sees of one agent in one run of its pattern."""

    #: ``executor.id`` of the nearest ``executor.process`` span around the agent's ``invoke_agent``
    #: (None: no workflow around it).
    executor_id: str | None
    chat_calls: int
    input_tokens: int
    output_tokens: int
    finish_reason: str | None
    #: Chat calls that raised (their chat spans carry error.type and no usage).
    failed_calls: int = 0
    #: The :func:`drive` turn (1-based) in which the agent runs; 0: it never runs (idle participant).
    run_turn: int = 1
    #: Agent-as-tool: the agent whose tool call invoked this one (its invoke_agent nests in that one's).
    nested_in: str | None = None


@dataclass(frozen=True)
class Placement:
    executor_id: str | None
    run_turn: int = 1
    nested_in: str | None = None
    #: How many of the script's turns the pattern consumes (None: all of them).
    uses: int | None = None


def facts_from_script(spec: AgentSpec, where: Placement) -> AgentFacts:
    turns = list(spec.turns)[: where.uses] if where.uses is not None else list(spec.turns)
    answered = [t for t in turns if not t.error]
    reported = [t for t in answered if t.report]
    return AgentFacts(
        executor_id=where.executor_id, chat_calls=len(turns),
        input_tokens=sum(t.input_tokens for t in reported), output_tokens=sum(t.output_tokens for t in reported),
        finish_reason=reported[-1].finish_reason if reported and answered[-1].report else None,
        failed_calls=len(turns) - len(answered), run_turn=where.run_turn if turns else 0, nested_in=where.nested_in)


Responder = Callable[[Any], Any]


@dataclass
class Pattern:
    name: str
    about: str
    specs: dict[str, AgentSpec]
    placements: dict[str, Placement]
    _build: Callable[[dict[str, AgentSpec]], Any] = field(repr=False)
    #: Answers a ``request_info`` event (its ``data``) for :func:`drive`; None: the pattern asks nothing.
    respond: Responder | None = None
    task: str = TASK
    #: The exception type :func:`drive` is expected to capture, if any.
    fails_with: str | None = None
    #: How many :func:`drive` turns the pattern takes.
    turns: int = 1
    agents: dict[str, AgentFacts] = field(init=False)

    def __post_init__(self) -> None:
        self.agents = self.facts()

    def specs_with(self, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, AgentSpec]:
        overrides = overrides or {}
        unknown = set(overrides) - set(self.specs)
        if unknown:
            raise KeyError(f"pattern {self.name!r} has no agent(s) {sorted(unknown)}; agents: {sorted(self.specs)}")
        return {name: dataclasses.replace(spec, **dict(overrides.get(name, {}))) for name, spec in self.specs.items()}

    def build(self, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
        """A fresh workflow (or agent): every build has new agents and clients, scripts rewound."""
        return self._build(self.specs_with(overrides))

    def facts(self, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, AgentFacts]:
        """The agents' facts for a build with ``overrides`` (they matter when ``turns`` is overridden)."""
        specs = self.specs_with(overrides)
        return {name: facts_from_script(specs[name], self.placements[name]) for name in specs}


def _specs(*specs: AgentSpec) -> dict[str, AgentSpec]:
    return {s.name: s for s in specs}


def _at(*names: str, **kwargs: Any) -> dict[str, Placement]:
    """Placements of agents that run under their own executor id (the agent's name)."""
    return {n: Placement(n, **kwargs) for n in names}


def _tool_loop(first: tuple[int, int], last: tuple[int, int], finish: str = "stop") -> list[Turn]:
    return [Turn(*first, "tool_calls", tool_call="lookup"), Turn(*last, finish)]


# region builders


def _sequential(name: str, **options: Any) -> Callable[[dict[str, AgentSpec]], Workflow]:
    def build(specs: dict[str, AgentSpec]) -> Workflow:
        return SequentialBuilder(name=name, participants=[agent(s) for s in specs.values()], **options).build()

    return build


def _concurrent(specs: dict[str, AgentSpec]) -> Workflow:
    return ConcurrentBuilder(name="concurrent", participants=[agent(s) for s in specs.values()]).build()


def _fan_in_graph(specs: dict[str, AgentSpec]) -> Workflow:
    planner, branch_a, branch_b = (agent(specs[n]) for n in ("planner", "branch_a", "branch_b"))

    @executor(id="merge")
    async def merge(results: list[AgentExecutorResponse], ctx: WorkflowContext[Never, str]) -> None:
        await ctx.yield_output(" | ".join(f"{r.executor_id}: {r.agent_response.text}" for r in results))

    return (WorkflowBuilder(name="fan_in_graph", start_executor=planner, output_from=[merge])
            .add_fan_out_edges(planner, [branch_a, branch_b])
            .add_fan_in_edges([branch_a, branch_b], merge)
            .build())


HANDOFF_DONE = "RESOLVED by billing"


def _handoff(specs: dict[str, AgentSpec]) -> Workflow:
    triage, billing, refunds = (agent(specs[n], require_per_service_call_history_persistence=True)
                                for n in ("triage", "billing", "refunds"))
    return (HandoffBuilder(name="handoff", participants=[triage, billing, refunds],
                           # Ends the run once the specialist has answered, instead of asking the user.
                           termination_condition=lambda conv: any(HANDOFF_DONE in m.text for m in conv))
            .with_start_agent(triage)
            .build())


def _round_robin(state: GroupChatState) -> str:
    names = list(state.participants)
    return names[state.current_round % len(names)]


def _group_chat_round_robin(specs: dict[str, AgentSpec]) -> Workflow:
    return GroupChatBuilder(name="group_chat_round_robin", participants=[agent(s) for s in specs.values()],
                            selection_func=_round_robin, max_rounds=4).build()


def _group_chat_manager(specs: dict[str, AgentSpec]) -> Workflow:
    return GroupChatBuilder(name="group_chat_manager",
                            participants=[agent(specs["expert_a"]), agent(specs["expert_b"])],
                            orchestrator_agent=agent(specs["moderator"]), max_rounds=6).build()


def _magentic(specs: dict[str, AgentSpec]) -> Workflow:
    return MagenticBuilder(name="magentic", participants=[agent(specs["researcher"]), agent(specs["coder"])],
                           manager_agent=agent(specs["manager"]), max_round_count=6).build()


def _sub_workflow(specs: dict[str, AgentSpec]) -> Workflow:
    drafter, editor = agent(specs["drafter"]), agent(specs["editor"])
    inner = (WorkflowBuilder(name="drafting_inner", start_executor=drafter, output_from=[editor])
             .add_edge(drafter, editor).build())
    drafting = WorkflowExecutor(inner, id="drafting")

    @executor(id="publish")
    async def publish(response: AgentResponse, ctx: WorkflowContext[Never, str]) -> None:
        await ctx.yield_output(f"published: {response.text}")

    scout = agent(specs["scout"])
    return (WorkflowBuilder(name="sub_workflow", start_executor=scout, output_from=[publish])
            .add_edge(scout, drafting).add_edge(drafting, publish).build())


def _agent_as_tool(specs: dict[str, AgentSpec]) -> Workflow:
    calculator = agent(specs["calculator"])
    outer = dataclasses.replace(specs["assistant"], tools=[*specs["assistant"].tools, calculator.as_tool()])
    return WorkflowBuilder(name="agent_as_tool", start_executor=agent(outer)).build()


def _human_in_the_loop(specs: dict[str, AgentSpec]) -> Workflow:
    return (SequentialBuilder(name="human_in_the_loop", participants=[agent(s) for s in specs.values()])
            .with_request_info().build())


def _approve(request: Any) -> Any:
    """Approve whatever the orchestration asks the human about (nothing more for the agents to do)."""
    if isinstance(request, HandoffAgentUserRequest):
        return HandoffAgentUserRequest.terminate()
    return AgentRequestInfoResponse.approve()


def _as_agent(specs: dict[str, AgentSpec]) -> Agent:
    workflow = SequentialBuilder(name="as_agent", participants=[agent(s) for s in specs.values()]).build()
    return workflow.as_agent(name="pipeline")


def _direct_agent(specs: dict[str, AgentSpec]) -> Agent:
    return agent(specs["solo"])


# endregion


def _patterns() -> list[Pattern]:
    return [
        Pattern("sequential", "SequentialBuilder of 3 agents, default outputs (the last agent's)",
                _specs(AgentSpec("researcher", [Turn(420, 180)]),
                       AgentSpec("writer", _tool_loop((300, 40), (610, 350)), tools=[lookup]),
                       AgentSpec("reviewer", [Turn(700, 90, "length")])),
                _at("researcher", "writer", "reviewer"), _sequential("sequential")),
        Pattern("sequential_all", "SequentialBuilder, intermediate_output_from='all_other'",
                _specs(AgentSpec("researcher", [Turn(430, 185)]),
                       AgentSpec("writer", _tool_loop((305, 45), (620, 355)), tools=[lookup]),
                       AgentSpec("reviewer", [Turn(710, 95)])),
                _at("researcher", "writer", "reviewer"),
                _sequential("sequential_all", intermediate_output_from="all_other")),
        Pattern("concurrent", "ConcurrentBuilder of 3 agents: dispatcher -> agents -> aggregator",
                _specs(AgentSpec("analyst", [Turn(510, 120)]),
                       AgentSpec("critic", _tool_loop((260, 30), (530, 140)), tools=[lookup]),
                       AgentSpec("summarizer", [Turn(550, 160, "length")])),
                _at("analyst", "critic", "summarizer"), _concurrent),
        Pattern("fan_in_graph", "WorkflowBuilder: planner -> fan-out to 2 agents -> fan-in to a function executor",
                _specs(AgentSpec("planner", [Turn(400, 60)]),
                       AgentSpec("branch_a", [Turn(440, 210)]),
                       AgentSpec("branch_b", _tool_loop((280, 35), (460, 230)), tools=[lookup])),
                _at("planner", "branch_a", "branch_b"), _fan_in_graph),
        Pattern("handoff", "HandoffBuilder: triage hands off to billing via handoff_to_billing; refunds idle",
                _specs(AgentSpec("triage", [Say(350, 25, "tool_calls", tool_call="handoff_to_billing", arguments={})]),
                       AgentSpec("billing", [Say(520, 140, text=HANDOFF_DONE)]),
                       AgentSpec("refunds", [Turn(999, 99)])),
                {**_at("triage", "billing"), "refunds": Placement("refunds", uses=0)}, _handoff, respond=_approve),
        Pattern("group_chat_round_robin", "GroupChatBuilder, round-robin selection_func, max_rounds=4",
                _specs(AgentSpec("proposer", [Turn(610, 70), Turn(640, 75)]),
                       AgentSpec("skeptic", [Turn(620, 80), Turn(650, 85, "length")])),
                _at("proposer", "skeptic"), _group_chat_round_robin),
        Pattern("group_chat_manager", "GroupChatBuilder(orchestrator_agent=moderator): 3 manager calls",
                _specs(AgentSpec("moderator", [Say(300, 30, text=_pick("expert_a")),
                                               Say(320, 32, text=_pick("expert_b")),
                                               Say(340, 34, text=_pick(None, terminate=True))]),
                       AgentSpec("expert_a", [Turn(720, 160)]),
                       AgentSpec("expert_b", [Turn(740, 170)])),
                _at("moderator", "expert_a", "expert_b"), _group_chat_manager),
        Pattern("magentic", "MagenticBuilder, StandardMagenticManager on a scripted manager agent",
                _specs(AgentSpec("manager", [Say(800, 100, text="Facts: none needed."),
                                             Say(820, 110, text="Plan: researcher, then coder."),
                                             Say(840, 60, text=_ledger("researcher")),
                                             Say(860, 62, text=_ledger("coder")),
                                             Say(880, 64, text=_ledger("coder", satisfied=True)),
                                             Say(900, 150, text="Final answer.")]),
                       AgentSpec("researcher", [Turn(460, 190)]),
                       AgentSpec("coder", _tool_loop((270, 35), (480, 210)), tools=[lookup])),
                {"manager": Placement("magentic_orchestrator"), **_at("researcher", "coder")}, _magentic),
        Pattern("sub_workflow", "scout -> WorkflowExecutor 'drafting' (drafter -> editor) -> function 'publish'",
                _specs(AgentSpec("scout", [Turn(410, 90)]),
                       AgentSpec("drafter", [Turn(560, 240)]),
                       AgentSpec("editor", [Turn(580, 120)])),
                _at("scout", "drafter", "editor"), _sub_workflow),
        Pattern("agent_as_tool", "one-agent workflow; assistant's tools include calculator.as_tool()",
                _specs(AgentSpec("assistant", [Say(330, 60, "tool_calls", tool_call="calculator",
                                                   arguments={"task": "2+2"}), Turn(480, 120)]),
                       AgentSpec("calculator", [Turn(230, 45)])),
                {"assistant": Placement("assistant"), "calculator": Placement("assistant", nested_in="assistant")},
                _agent_as_tool),
        Pattern("human_in_the_loop", "SequentialBuilder.with_request_info(): writer (turn 1), editor (turn 2), "
                                     "approval only (turn 3)",
                _specs(AgentSpec("writer", [Turn(630, 270)]), AgentSpec("editor", [Turn(650, 110)])),
                {"writer": Placement("writer", run_turn=1), "editor": Placement("editor", run_turn=2)},
                _human_in_the_loop, respond=_approve, turns=3),
        Pattern("failing_call", "SequentialBuilder of 2; the writer's chat call raises 429",
                _specs(AgentSpec("researcher", [Turn(420, 180)]),
                       AgentSpec("writer", [Turn(610, 350, error="429 Too Many Requests")])),
                _at("researcher", "writer"), _sequential("failing_call"), fails_with="ChatClientException"),
        Pattern("as_agent", "workflow.as_agent() of a 2-agent sequential workflow, agent.run(task)",
                _specs(AgentSpec("outliner", [Turn(370, 140)]), AgentSpec("finisher", [Turn(390, 150)])),
                _at("outliner", "finisher"), _as_agent),
        Pattern("direct_agent", "a plain agent.run(task), no workflow, one tool loop",
                _specs(AgentSpec("solo", _tool_loop((150, 20), (260, 90)), tools=[lookup])),
                {"solo": Placement(None)}, _direct_agent),
    ]


PATTERNS: dict[str, Pattern] = {p.name: p for p in _patterns()}


# endregion

# region driving


@dataclass
class DriveTurn:
    """One ``run`` call: its events (streamed updates for an agent), its result, the error it raised."""

    events: list[Any]
    result: Any = None
    error: BaseException | None = None
    #: The responses this turn delivered (None: the first turn, which sent the task).
    responses: dict[str, Any] | None = None

    @property
    def requests(self) -> list[Any]:
        return [e for e in self.events if getattr(e, "type", None) == "request_info"]


async def drive(pattern: Pattern, workflow: Any, stream: bool, *, max_turns: int = 8) -> list[DriveTurn]:
    """Run ``workflow`` (or an agent) to completion, answering request_info events with ``pattern.respond``.

    One :class:`DriveTurn` per ``run`` call. Never raises for a failing run: the error is captured in
    the turn (streaming: with the events seen before it, including ``failed``; plain: ``run`` raises
    before returning any event).
    """
    if not isinstance(workflow, Workflow):
        turn = DriveTurn(events=[])
        try:
            if stream:
                response_stream = workflow.run(pattern.task, stream=True)
                async for update in response_stream:
                    turn.events.append(update)
                turn.result = await response_stream.get_final_response()
            else:
                turn.result = await workflow.run(pattern.task)
        except Exception as exc:  # drive reports, never raises
            turn.error = exc
        return [turn]

    turns: list[DriveTurn] = []
    responses: dict[str, Any] | None = None
    for _ in range(max_turns):
        turn = DriveTurn(events=[], responses=responses)
        turns.append(turn)
        kwargs: dict[str, Any] = {"responses": responses} if responses is not None else {"message": pattern.task}
        try:
            if stream:
                response_stream = workflow.run(stream=True, **kwargs)
                async for event in response_stream:
                    turn.events.append(event)
                turn.result = await response_stream.get_final_response()
            else:
                turn.result = await workflow.run(**kwargs)
                turn.events = list(turn.result)
        except Exception as exc:
            turn.error = exc
            break
        requests = turn.requests
        if not requests or pattern.respond is None:
            break
        responses = {event.request_id: pattern.respond(event.data) for event in requests}
    return turns


# endregion

# region spans -> facts


def observed_facts(spans: Sequence[Any]) -> dict[str, list[AgentFacts]]:
    """Per agent name, one :class:`AgentFacts` per ``invoke_agent`` span, read back from finished spans.

    Chat calls are the chat spans under the invoke_agent span, not under a nested invoke_agent;
    ``run_turn`` is left 1 (a trace does not know its drive turn)."""
    by_id = {s.context.span_id: s for s in spans}
    children: dict[int, list[Any]] = {}
    for s in spans:
        if s.parent is not None:
            children.setdefault(s.parent.span_id, []).append(s)

    def op(s: Any) -> str | None:
        return (s.attributes or {}).get("gen_ai.operation.name")

    def ancestors(s: Any):
        while s.parent is not None and s.parent.span_id in by_id:
            s = by_id[s.parent.span_id]
            yield s

    out: dict[str, list[AgentFacts]] = {}
    for s in spans:
        if op(s) != "invoke_agent":
            continue
        executor_id = nested_in = None
        for a in ancestors(s):
            if op(a) == "invoke_agent" and nested_in is None and executor_id is None:
                nested_in = a.attributes.get("gen_ai.agent.name")
            if a.name.startswith("executor.process"):
                executor_id = a.attributes.get("executor.id")
                break
        chats: list[Any] = []
        stack = list(children.get(s.context.span_id, []))
        while stack:
            c = stack.pop()
            if op(c) == "invoke_agent":
                continue
            if op(c) == "chat":
                chats.append(c)
            stack.extend(children.get(c.context.span_id, []))
        chats.sort(key=lambda c: c.start_time)
        answered = [c for c in chats if "error.type" not in c.attributes]
        finish = None
        if answered and "gen_ai.response.finish_reasons" in answered[-1].attributes:
            reasons = answered[-1].attributes["gen_ai.response.finish_reasons"]
            reasons = json.loads(reasons) if isinstance(reasons, str) else list(reasons)
            finish = reasons[-1] if reasons else None
        out.setdefault(s.attributes.get("gen_ai.agent.name"), []).append(AgentFacts(
            executor_id=executor_id, chat_calls=len(chats),
            input_tokens=sum(c.attributes.get("gen_ai.usage.input_tokens", 0) for c in answered),
            output_tokens=sum(c.attributes.get("gen_ai.usage.output_tokens", 0) for c in answered),
            finish_reason=finish, failed_calls=len(chats) - len(answered), nested_in=nested_in))
    return out


def merge_facts(invocations: Sequence[AgentFacts]) -> AgentFacts:
    """Several invocations of one agent (a group chat speaker, a manager) summed into one."""
    last = invocations[-1]
    return dataclasses.replace(
        last, chat_calls=sum(f.chat_calls for f in invocations),
        input_tokens=sum(f.input_tokens for f in invocations), output_tokens=sum(f.output_tokens for f in invocations),
        failed_calls=sum(f.failed_calls for f in invocations))


# endregion
