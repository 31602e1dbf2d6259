"""One model call, one truth entry on the telemetry stacks users run (docs/design.md §1,
docs/instrumentation-stacks.md): MAF's real provider clients on the tests' model server, real MAF
workflows, the fidelity instrumentation with each stack of provider instrumentations, exported over
real OTLP to a running collector. Every stack must give the verdicts the fidelity instrumentation
alone gives, and still catch an injected under-report and a dropped finish reason."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_framework import Agent

from collector.core.model import FINISH_REASON_MAP

import maf_stacks as ms
from conftest import export_spans, runs_of
from llm_server import LLMServer, Reply

#: Where a stack cannot see what the test needs, what the user sees instead (measured:
#: docs/instrumentation-stacks.md). "finish_unseen": the calls' spans carry usage but no finish
#: reason, so a dropped finish has nothing to be compared with; "incomplete_unseen": an incomplete
#: response (the dropped-finish writer's content_filter) has no span, so that unit has no chat truth.
LIMITS: dict[tuple[str, str, bool | None], str] = {
    ("provider-only-openai-v2", "chat-completions", True): "finish_unseen",  # v2's streamed span: no finish
    ("provider-only-openai-v2", "anthropic", None): "finish_unseen",  # the anthropic SDK's own span: no finish
    ("provider-only-openllmetry", "responses", False): "incomplete_unseen",  # OpenLLMetry: completed ones only
    ("provider-only-openllmetry", "responses", True): "no_chat_trace",  # OpenLLMetry: no span for a streamed response
}


#: Where the record of a call that stands counts differently: OpenLLMetry's streamed Anthropic span
#: adds message_start's output token to the final count (one more per call than the SDK's own span
#: beside it), and stands for both (it also has the finish reason).
EXTRA_TRUTH_PER_CALL: dict[tuple[str, str, bool], int] = {("provider-only-openllmetry", "anthropic", True): 1}


def limit(stack: str, client: str, stream: bool) -> str | None:
    return LIMITS.get((stack, client, stream)) or LIMITS.get((stack, client, None))


@pytest.fixture(scope="module")
def server():
    srv = LLMServer()
    yield srv
    srv.close()


# --- driving and reading back -------------------------------------------------------------------

def drive(maf_spans, server: LLMServer, stack: ms.Stack, client: str,
          scenarios: tuple[str, ...] = ("honest", "injected", "direct"),
          ) -> tuple[list[Any], dict[tuple[str, bool], str]]:
    """``scenarios``, plain and streamed, under ``stack``: the finished spans and each run's trace id."""
    spans: list[Any] = []
    traces: dict[tuple[str, bool], str] = {}

    async def main() -> None:
        clients = ms.Clients(client, server.base_url, maf_chat=stack.maf_chat)
        try:
            for stream in (False, True):
                for scenario in ms.scenarios(client):
                    if scenario.name not in scenarios:
                        continue
                    maf_spans.clear()
                    ms.script(server, scenario.name, client)
                    await ms.run(ms.build(scenario.name, clients), stream)
                    finished = list(maf_spans.get_finished_spans())
                    (traces[scenario.name, stream],) = {format(s.context.trace_id, "032x") for s in finished
                                                        if s.name.startswith("invoke_agent")}
                    spans.extend(finished)
        finally:
            await clients.aclose()

    server.reset()
    maf_spans.clear()
    with ms.active(stack):
        asyncio.run(main())
    spans.extend(maf_spans.get_finished_spans())  # any span ended after its run (none expected)
    assert server.unplayed() == {}, server.unplayed()
    return spans, traces


def seen(run: dict) -> dict[str, tuple]:
    """Per unit: (verdict, framework tokens, truth tokens, framework finish, truth finish); finishes in
    the GenAI conventions' words (the evidence keeps each vendor's: Anthropic's ``refusal``)."""
    def finish(reason: str | None) -> str | None:
        return FINISH_REASON_MAP.get(reason.lower(), reason.lower()) if reason else reason

    return {e["executor_id"]: (e["verdict"], e["evidence"]["framework_tokens"], e["evidence"]["truth_tokens"],
                               finish(e["evidence"]["framework_finish"]), finish(e["evidence"]["truth_finish"]))
            for e in run["executors"]}


def expected(scenario: ms.Scenario, lim: str | None) -> tuple[dict[str, tuple], str]:
    units = dict(scenario.expected)
    if lim == "no_chat_trace":
        return {u: ("NoTruth", fw, None, ff, None) for u, (_, fw, _, ff, _) in units.items()}, "PENDING"
    for u, (v, fw, tt, ff, _) in units.items():
        if v == "FinishMismatch" and lim == "finish_unseen":
            units[u] = ("Agree", fw, tt, ff, None)
        elif v == "FinishMismatch" and lim == "incomplete_unseen":
            units[u] = ("NoTruth", fw, None, ff, None)
        elif lim == "finish_unseen":
            units[u] = (v, fw, tt, ff, None)
    return units, scenario.status


# --- the matrix ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stack,client", [(stack.name, client) for stack in ms.STACKS.values()
                                           for client in stack.clients])
def test_every_stack_gives_the_verdicts_of_the_fidelity_instrumentation_alone(
        maf_spans, collector, server, stack, client):
    st = ms.STACKS[stack]
    spans, traces = drive(maf_spans, server, st, client)
    export_spans(collector, spans)
    assert not wrong_verdicts(collector, traces, stack, client)


def wrong_verdicts(collector, traces: dict[tuple[str, bool], str], stack: str, client: str) -> dict[str, dict]:
    """The stored runs of ``traces`` ((scenario, streamed) -> trace id) that differ from what the user
    must see: {run: {"got": ..., "want": ...}}."""
    runs = {r["trace_id"]: r for r in runs_of(collector, list(traces.values()))}
    assert len(runs) == len(traces), sorted(runs)
    wrong = {}
    for (name, stream), trace_id in traces.items():
        scenario = next(s for s in ms.scenarios(client) if s.name == name)
        units, status = expected(scenario, limit(stack, client, stream))
        if extra := EXTRA_TRUTH_PER_CALL.get((stack, client, stream)):
            units = {u: (v, fw, tt + extra * ms.CALLS[u], ff, tf) for u, (v, fw, tt, ff, tf) in units.items()}
        run = runs[trace_id]
        reasons = ({e["no_truth_reason"] for e in run["executors"]},) if status == "PENDING" else ()
        want = (units, status) + (({"no_chat_trace"},) if status == "PENDING" else ())
        got = (seen(run), run["status"], *reasons)
        if got != want:
            wrong[f"{name}-{'stream' if stream else 'plain'}"] = {"got": got, "want": want}
    return wrong


# --- the zero-code path ----------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def zero_code() -> Path:
    """An application environment at this environment's versions, after `opentelemetry-bootstrap -a
    install` (tools/zero-code-venv: built once, rebuilt when its inputs change)."""
    venv = Path(sys.prefix).with_name(f"{Path(sys.prefix).name}-zerocode")  # .venv-zerocode beside .venv
    subprocess.run([str(REPO / "tools" / "zero-code-venv"), sys.prefix, str(venv)], check=True, timeout=900)
    return venv


def _freeze(path: Path) -> dict[str, str]:
    return dict(line.split("==", 1) for line in path.read_text().splitlines() if "==" in line)


def test_opentelemetry_bootstrap_only_adds_instrumentations(zero_code):
    # What `opentelemetry-bootstrap -a install` did to an agent application's environment: it added
    # instrumentations (openai-v2 among them, for openai) and their helpers, changed or removed
    # nothing that was there, and left pip's dependency check clean.
    before, after = _freeze(zero_code / "before.txt"), _freeze(zero_code / "after.txt")
    assert {name: after.get(name) for name in before} == before
    added = set(after) - set(before)
    assert "opentelemetry-instrumentation-openai-v2" in added
    assert all(name.startswith("opentelemetry-") for name in added), added
    assert (zero_code / "pip-check.rc").read_text().strip() == "0", (zero_code / "pip-check.txt").read_text()


def test_the_zero_code_path_gives_the_verdicts_of_the_fidelity_instrumentation_alone(zero_code, collector, server):
    # opentelemetry-instrument with OTEL_* variables only: MAF's telemetry, the fidelity
    # instrumentation and everything bootstrap added (openai-v2, httpx) activate by entry point.
    client = "chat-completions"
    server.reset()
    for _stream in (False, True):
        for scenario in ms.scenarios(client):
            ms.script(server, scenario.name, client)
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "AGENTEVAL_TEST_LLM_URL": server.base_url,
           "OTEL_SERVICE_NAME": "zero-code-app", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_LOGS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{collector.grpc}"}
    proc = subprocess.run([str(zero_code / "bin" / "opentelemetry-instrument"), str(zero_code / "bin" / "python"),
                           str(REPO / "tests" / "stack_app.py"), client],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["instrumented"] == {"openai-v2": True}  # the stack of the issue: openai-v2 under MAF's chat span
    assert server.unplayed() == {}
    traces = {(name, stream == "stream"): trace_id
              for key, trace_id in out["traces"].items() for name, stream in [key.split("-")]}
    assert not wrong_verdicts(collector, traces, "zero-code", client)


# --- count parts and layers that disagree ---------------------------------------------------------

def test_cache_and_reasoning_parts_are_shown_never_added_and_disagreeing_layers_are_named(
        maf_spans, collector, server):
    # OpenAI, every layer on: the researcher's first call has 64 cached input and 8 reasoning
    # tokens, parts of its 120 + 40; MAF's span and OpenLLMetry's say so, openai-v2's beneath them not.
    spans, traces = drive(maf_spans, server, ms.STACKS["all"], "chat-completions", scenarios=("honest",))
    export_spans(collector, spans)
    for trace_id in (traces["honest", False], traces["honest", True]):
        (run,) = runs_of(collector, [trace_id])
        researcher = next(e for e in run["executors"] if e["executor_id"] == "researcher")["evidence"]
        assert (researcher["truth_tokens"], researcher["truth_cache_read_tokens"],
                researcher["truth_reasoning_tokens"]) == (ms.RESEARCHER_TOKENS, 64, 8)
        assert researcher["stacked_chat_spans"] == 4, researcher  # two calls, each recorded twice more beneath MAF's
        assert researcher["chat_layers_disagree"] == []

    # Anthropic: MAF's span counts Anthropic's raw input_tokens (cache reads apart), the SDK's own
    # span beneath it counts them in, as the GenAI conventions do: the call counts once (MAF's, the
    # outermost, which the framework's response matches), and the evidence names the disagreement.
    server.reset()
    server.script("assistant", [Reply(100, 20, cached=30)])

    async def main() -> None:
        clients = ms.Clients("anthropic", server.base_url)
        try:
            await ms.run(Agent(clients("assistant"), name="assistant"), False)
        finally:
            await clients.aclose()

    maf_spans.clear()
    asyncio.run(main())
    spans = list(maf_spans.get_finished_spans())
    export_spans(collector, spans)
    (run,) = runs_of(collector, list({format(s.context.trace_id, "032x") for s in spans}))
    (assistant,) = run["executors"]
    ev = assistant["evidence"]
    assert (assistant["verdict"], ev["framework_tokens"], ev["truth_tokens"], ev["truth_cache_read_tokens"]) == (
        "Agree", 90, 90, 30)
    (disagree,) = ev["chat_layers_disagree"]
    assert (disagree["tokens"], disagree["inner_tokens"]) == (90, 120)
