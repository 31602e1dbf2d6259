"""Agents created without a name (``Agent(client, instructions=...)``, as many MAF samples do) in
real agent-framework workflows on scripted chat clients, exported over real OTLP to a running
collector: every unnamed agent is a unit of its own, named ``unnamed-agent-{n}`` or by the executor
hosting it, never by MAF's per-process id, and the same in every run of a freshly built workflow;
one agent under-reporting is caught on its own unit with its own numbers (issue 58)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from agent_framework import AgentExecutor, Executor, WorkflowBuilder, WorkflowContext, handler
from agent_framework_orchestrations import ConcurrentBuilder, GroupChatBuilder, GroupChatState, SequentialBuilder

from collector.demo.maf_fakes import Turn, under_report

from maf_real_world import real_agent, total
from test_maf_real_world import STREAM, UUID_LIKE, numbers, one_run, unit, verdicts

#: Three unnamed agents' scripts (each a tool-free single call, distinct totals); the second lies.
TURNS = ([Turn(410, 90)], [Turn(520, 180)], [Turn(630, 110)])
TOKENS = [total(t) for t in TURNS]  # 500, 700, 740
LIAR = 1  # index of the agent whose middleware halves its reported usage
HALF = TOKENS[LIAR] // 2  # what it reports: 350 of 700


def agents(liar: int | None) -> list[Any]:
    """Three fresh unnamed agents (new MAF ids every call), the ``liar``-th halving its usage."""
    return [real_agent(None, turns, middleware=[under_report(0.5)] if i == liar else ())
            for i, turns in enumerate(TURNS)]


# --- the shapes ----------------------------------------------------------------------------------

def graph(liar: int | None) -> Any:
    """(a) WorkflowBuilder: AgentExecutors without ids (MAF names each by its agent's id), a chain."""
    first, second, third = (AgentExecutor(a) for a in agents(liar))
    return (WorkflowBuilder(name="unnamed_graph", start_executor=first)
            .add_edge(first, second).add_edge(second, third).build())


def sequential(liar: int | None) -> Any:
    """(b) SequentialBuilder with three unnamed agents."""
    return SequentialBuilder(name="unnamed_sequential", participants=agents(liar)).build()


def concurrent(liar: int | None) -> Any:
    """(c) ConcurrentBuilder with three unnamed agents."""
    return ConcurrentBuilder(name="unnamed_concurrent", participants=agents(liar)).build()


def _round_robin(state: GroupChatState) -> str:
    names = list(state.participants)
    return names[state.current_round % len(names)]


def group_chat(liar: int | None) -> Any:
    """(d) GroupChatBuilder: it takes only named agents, so the unnamed agents come as AgentExecutors
    without ids (named by their agents' ids); round-robin, each speaks once."""
    return GroupChatBuilder(name="unnamed_group_chat", participants=[AgentExecutor(a) for a in agents(liar)],
                            selection_func=_round_robin, max_rounds=3).build()


class TwoAgents(Executor):
    """(e) A custom executor whose handler runs two unnamed agents of the same class one after the
    other (the second answering the first)."""

    def __init__(self, pair: Sequence[Any]) -> None:
        super().__init__(id="pair")
        self._pair = list(pair)

    @handler
    async def run(self, task: str, ctx: WorkflowContext[Any, str]) -> None:
        text = task
        for agent in self._pair:
            text = (await agent.run(text)).text
        await ctx.yield_output(text)


def pair_in_one_executor(liar: int | None) -> Any:
    return WorkflowBuilder(name="unnamed_pair", start_executor=TwoAgents(agents(liar)[:2])).build()


SHAPES = pytest.mark.parametrize("build,names", [
    (graph, ["unnamed-agent-1", "unnamed-agent-2", "unnamed-agent-3"]),
    (sequential, ["unnamed-agent-1", "unnamed-agent-2", "unnamed-agent-3"]),
    (concurrent, ["unnamed-agent-1", "unnamed-agent-2", "unnamed-agent-3"]),
    (group_chat, ["unnamed-agent-1", "unnamed-agent-2", "unnamed-agent-3"]),
    (pair_in_one_executor, ["pair/unnamed-agent-1", "pair/unnamed-agent-2"]),
], ids=["graph", "sequential", "concurrent", "group_chat", "two_in_one_executor"])


def by_unit(run: dict) -> dict[str, tuple]:
    """Unit name -> (verdict, framework tokens, truth tokens)."""
    return {name: (verdict, *numbers(run, name)) for name, verdict in verdicts(run).items()}


@SHAPES
@STREAM
def test_every_unnamed_agent_is_its_own_unit_and_an_honest_run_passes(maf_spans, collector, stream, build, names):
    seen = []
    for _ in range(2):  # a freshly built workflow each time: new agents, new MAF ids
        run = one_run(maf_spans, collector, build(None), stream)
        got = by_unit(run)
        assert not [n for n in got if UUID_LIKE.search(n)], got
        assert got == {name: ("Agree", tokens, tokens) for name, tokens in zip(names, TOKENS, strict=False)}, got
        assert run["status"] == "PASS" and run["score"] == 1.0
        assert not UUID_LIKE.search(run["subject"] or ""), run["subject"]
        assert not [e for e in run["non_agent_executors"] if UUID_LIKE.search(e)], run["non_agent_executors"]
        seen.append(sorted(got))
    assert seen[0] == seen[1] == sorted(names)


@SHAPES
@STREAM
def test_the_one_unnamed_agent_under_reporting_is_a_token_mismatch_on_its_own_unit(
        maf_spans, collector, stream, build, names):
    seen = []
    for _ in range(2):
        run = one_run(maf_spans, collector, build(LIAR), stream)
        got = by_unit(run)
        assert not [n for n in got if UUID_LIKE.search(n)], got
        expected = {name: ("Agree", tokens, tokens) for name, tokens in zip(names, TOKENS, strict=False)}
        expected[names[LIAR]] = ("TokenMismatch", HALF, TOKENS[LIAR])
        assert got == expected, got
        assert unit(run, names[LIAR])["evidence"]["direction"] == "under"
        # one unit of n at half credit: 5/6 with three units is a WARN, 3/4 with two a FAIL (design §1)
        assert run["score"] == pytest.approx((len(names) - 0.5) / len(names), abs=0.01)
        assert run["status"] == ("WARN" if len(names) == 3 else "FAIL")
        seen.append(got)
    assert seen[0] == seen[1]
