"""The MAF Python instrumentation (docs/design.md §3b): every agent invocation's AgentResponse becomes an
``agent_response`` span where that agent ran, with no call-site change, on real agent-framework-core
agents and workflows."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from agent_framework import Agent, AgentResponse, BaseAgent
from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor

from collector.demo.maf_fakes import AgentSpec, InstrumentedChatClient, Turn, keep_last_call_usage, lookup, make_agent

from conftest import verdicts

TASK = "Write a short report."


def ledger_spans(spans) -> list:
    return [s for s in spans if s.attributes.get("fidelity.ledger.source") == "AgentResponseEvent"]


def run(maf_spans, coro) -> list:
    maf_spans.clear()
    asyncio.run(coro)
    return list(maf_spans.get_finished_spans())


def test_a_direct_agent_run_records_what_the_caller_received_under_its_agent_span(maf_spans):
    agent = make_agent(AgentSpec("writer", [Turn(300, 40, "tool_calls", tool_call="lookup"), Turn(420, 180)],
                                 tools=[lookup], middleware=[keep_last_call_usage()]))
    received: list[AgentResponse] = []

    async def go():
        received.append(await agent.run(TASK))

    spans = run(maf_spans, go())
    (ledger,) = ledger_spans(spans)
    (agent_span,) = [s for s in spans if s.name == "invoke_agent writer"]
    usage = received[0].usage_details
    # what the caller got (the middleware kept only the last call), not what invoke_agent re-summed
    assert (ledger.attributes["gen_ai.usage.input_tokens"], ledger.attributes["gen_ai.usage.output_tokens"]) == (
        usage["input_token_count"], usage["output_token_count"]) == (420, 180)
    assert agent_span.attributes["gen_ai.usage.input_tokens"] == 720  # MAF's re-sum
    assert ledger.parent.span_id == agent_span.context.span_id  # structural: where the agent ran
    assert ledger.context.trace_id == agent_span.context.trace_id
    assert tuple(ledger.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert ledger.attributes["gen_ai.agent.name"] == "writer" and ledger.attributes["fidelity.stream"] is False
    assert not any("message" in k or "instruction" in k for k in ledger.attributes)  # never prompt text


def test_layered_run_calls_record_once_per_invocation_plain_and_streamed(maf_spans):
    agent = make_agent(AgentSpec("solo", [Turn(50, 5), Turn(60, 6)]))

    async def go():
        await agent.run(TASK)
        async for _ in agent.run(TASK, stream=True):
            pass

    spans = run(maf_spans, go())
    recorded = [(s.attributes["fidelity.stream"], s.attributes["gen_ai.usage.input_tokens"])
                for s in ledger_spans(spans)]
    assert recorded == [(False, 50), (True, 60)]
    assert not any(s.attributes.get("fidelity.stream.closed_early") for s in ledger_spans(spans))


def test_a_stream_the_caller_stops_reading_records_what_it_received(maf_spans):
    agent = make_agent(AgentSpec("streamer", [Turn(70, 7)]))

    async def go():
        stream = agent.run(TASK, stream=True)
        async for _ in stream:
            break
        await stream.close()

    (ledger,) = ledger_spans(run(maf_spans, go()))
    assert ledger.attributes["fidelity.stream.closed_early"] is True
    assert "gen_ai.usage.input_tokens" not in ledger.attributes  # usage had not arrived yet


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_agent_that_raises_records_nothing(maf_spans, stream):
    agent = make_agent(AgentSpec("flaky", [Turn(1, 1, error="429 Too Many Requests")]))

    async def go():
        with pytest.raises(Exception, match="429"):
            if stream:
                async for _ in agent.run(TASK, stream=True):
                    pass
            else:
                await agent.run(TASK)

    assert ledger_spans(run(maf_spans, go())) == []


def test_agent_classes_defined_after_instrument_are_covered(maf_spans):
    class EchoAgent(BaseAgent):
        """A custom agent with its own run, defined after instrument()."""

        def run(self, messages=None, *, stream=False, **kwargs):
            async def respond():
                return AgentResponse(messages=[], usage_details={"input_token_count": 3, "output_token_count": 2})
            return respond()

    class Subclassed(Agent):
        pass

    async def go():
        await EchoAgent(name="echo").run(TASK)
        await Subclassed(InstrumentedChatClient(turns=[Turn(8, 1)]), name="sub").run(TASK)

    names = [s.attributes["gen_ai.agent.name"] for s in ledger_spans(run(maf_spans, go()))]
    assert names == ["echo", "sub"]


def test_uninstrument_restores_the_framework_and_instrument_brings_it_back(maf_spans):
    instrumentor = MafFidelityInstrumentor()
    agent = make_agent(AgentSpec("plain", [Turn(5, 5)]))
    instrumentor.uninstrument()
    try:
        assert ledger_spans(run(maf_spans, agent.run(TASK))) == []
        assert not hasattr(Agent.run, "__wrapped__")
    finally:
        instrumentor.instrument()
    assert len(ledger_spans(run(maf_spans, agent.run(TASK)))) == 1


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_default_opentelemetry_instrument_setup_sends_metrics_and_logs_too_and_prints_no_error(
        collector, tmp_path, protocol):
    """The distro's defaults export traces, metrics and logs to the same endpoint: the collector takes
    the metrics and logs (counted, discarded), so the app's output carries no export error."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent('''
        import asyncio, logging
        from opentelemetry import metrics, trace
        from agent_framework.observability import enable_instrumentation
        from collector.demo.maf_fakes import AgentSpec, Turn, chain

        enable_instrumentation()

        async def main():
            metrics.get_meter("app").create_counter("app.requests").add(1)
            logging.getLogger("app").warning("a log record the OTLP log exporter sends")
            with trace.get_tracer("app").start_as_current_span("request") as span:
                await chain("defaults", [AgentSpec("writer", [Turn(420, 180)])]).run("Write a short report.")
            print(format(span.get_span_context().trace_id, "032x"))

        asyncio.run(main())
    '''))
    endpoint = f"http://{collector.grpc}" if protocol == "grpc" else collector.http
    env = {**os.environ, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
           "OTEL_SERVICE_NAME": "defaults-app", "OTEL_PYTHON_LOGGING_AUTO_INSTRUMENTATION_ENABLED": "true",
           "OTEL_METRIC_EXPORT_INTERVAL": "200", "PYTHONPATH": str(Path(__file__).parent.parent)}
    for key in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER"):
        env.pop(key, None)  # the defaults: otlp for all three
    before = collector.metrics()
    proc = subprocess.run([str(Path(sys.executable).parent / "opentelemetry-instrument"), sys.executable, str(app)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to export" not in proc.stderr and "UNIMPLEMENTED" not in proc.stderr, proc.stderr
    assert collector.run(proc.stdout.split()[-1])["status"] == "PASS"
    after = collector.metrics()
    transport = "grpc" if protocol == "grpc" else "http"
    for signal in ("metrics", "logs"):
        key = ("agenteval_signals_discarded_total", (("signal", signal), ("transport", transport)))
        assert after.get(key, 0) > before.get(key, 0), signal


def test_opentelemetry_instrument_activates_it_with_no_code_change(collector, tmp_path):
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent('''
        import asyncio
        from opentelemetry import trace
        from agent_framework.observability import enable_instrumentation
        from collector.demo.maf_fakes import AgentSpec, Turn, chain, keep_last_call_usage, lookup

        enable_instrumentation()

        async def main():
            workflow = chain("auto-instrumented", [
                AgentSpec("researcher", [Turn(420, 180)]),
                AgentSpec("writer", [Turn(300, 40, "tool_calls", tool_call="lookup"), Turn(420, 180)],
                          tools=[lookup], middleware=[keep_last_call_usage()])])
            with trace.get_tracer("app").start_as_current_span("request") as span:
                await workflow.run("Write a short report.")
            print(format(span.get_span_context().trace_id, "032x"))

        asyncio.run(main())
    '''))
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{collector.grpc}",
           "OTEL_SERVICE_NAME": "auto-app", "PYTHONPATH": str(Path(__file__).parent.parent)}
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "opentelemetry-instrument"), sys.executable, str(app)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    trace_id = proc.stdout.strip().splitlines()[-1]
    run_doc = collector.run(trace_id)
    assert verdicts(run_doc) == {"researcher": "Agree", "writer": "TokenMismatch"}
    writer = next(e for e in run_doc["executors"] if e["executor_id"] == "writer")
    assert (writer["evidence"]["framework_tokens"], writer["evidence"]["truth_tokens"]) == (600, 940)
    assert writer["evidence"]["ledger_source"] == "AgentResponseEvent" and run_doc["status"] == "FAIL"


# --- releases: hooks, not a pin; the announcement (docs/design.md §3b) ------------------------------------

def test_the_installed_release_is_instrumented_announced_and_counted_by_release(maf_spans, collector):
    from importlib.metadata import version

    from opentelemetry.instrumentation.maf_fidelity.version import __version__

    from conftest import export_spans

    spans = run(maf_spans, make_agent(AgentSpec("solo", [Turn(50, 5)])).run(TASK))
    (ledger,) = ledger_spans(spans)
    (agent_span,) = [s for s in spans if s.name == "invoke_agent solo"]
    for span in (ledger, agent_span):
        assert (span.attributes["fidelity.maf.version"], span.attributes["fidelity.instrumentation.version"],
                span.attributes["fidelity.instrumentation.status"]) == (version("agent-framework-core"), __version__,
                                                                       "active")
    export_spans(collector, spans)
    run_doc = collector.run(format(ledger.context.trace_id, "032x"))
    assert (run_doc["maf_release"], run_doc["instrumentation_version"], run_doc["instrumentation_status"]) == (
        version("agent-framework-core"), __version__, "active")
    counted = {labels for (name, labels), _ in collector.metrics().items() if name == "agenteval_runs_total"}
    assert (("maf_release", version("agent-framework-core")), ("status", "PASS"),
            ("subject", run_doc["subject"])) in counted
    for release in (version("agent-framework-core"), version("agent-framework-core").rpartition(".")[0]):  # 1.26 too
        assert collector.store().list_runs(maf_release=release)[0]["run_id"] == run_doc["run_id"]
    assert collector.store().list_runs(maf_release="1.2") == []  # dotted parts, not characters


def test_a_release_outside_the_tested_range_is_instrumented_with_a_warning_and_a_missing_hook_is_named():
    from opentelemetry.instrumentation.maf_fidelity import status
    from opentelemetry.instrumentation.maf_fidelity.package import TESTED_NEWEST, TESTED_OLDEST

    assert status(TESTED_OLDEST, []) == status(TESTED_NEWEST, []) == "active"
    assert status("9.0.0", []) == (f"active, untested: agent-framework-core 9.0.0 is outside the tested "
                                   f"{TESTED_OLDEST} to {TESTED_NEWEST}")
    assert status("9.0.0", ["AgentTelemetryLayer._trace_agent_invocation"]) == (
        "inactive: agent-framework-core 9.0.0 lacks AgentTelemetryLayer._trace_agent_invocation")
    assert status(None, []) == "inactive: agent-framework-core is not installed"


INACTIVE_APP = '''
import asyncio, sys
from agent_framework import AgentResponse
from agent_framework.observability import enable_instrumentation
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from collector.demo.maf_fakes import AgentSpec, Turn, chain

# what a MAF release without this hook looks like (a plain run does not use it: MAF still works)
del AgentResponse.from_updates
provider = TracerProvider(resource=Resource.create({"service.name": "inactive-app"}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1], insecure=True)))
trace.set_tracer_provider(provider)
enable_instrumentation()
from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor
MafFidelityInstrumentor().instrument(tracer_provider=provider)

async def main():
    with trace.get_tracer("app").start_as_current_span("request") as span:
        await chain("inactive", [AgentSpec("writer", [Turn(420, 180)])]).run("Write a short report.")
    print(format(span.get_span_context().trace_id, "032x"))
asyncio.run(main())
provider.shutdown()
'''


def test_on_a_release_lacking_a_hook_it_records_nothing_says_which_and_the_fix_says_so(collector, tmp_path):
    app = tmp_path / "app.py"
    app.write_text(INACTIVE_APP)
    proc = subprocess.run([sys.executable, str(app), collector.grpc], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert proc.returncode == 0, proc.stderr
    assert "records nothing" in proc.stderr and "lacks AgentResponse.from_updates" in proc.stderr
    run_doc = collector.run(proc.stdout.split()[-1])
    assert run_doc["subject"] == "inactive" and run_doc["status"] == "PENDING"
    assert run_doc["instrumentation_status"].startswith("inactive: ")
    (writer,) = run_doc["executors"]
    assert (writer["executor_id"], writer["no_truth_reason"]) == ("writer", "ledger_derived")
    assert "is installed" in writer["no_truth_fix"] and "records nothing" in writer["no_truth_fix"]
    assert "install opentelemetry-instrumentation-maf-fidelity" not in writer["no_truth_fix"]


def test_an_active_instrumentation_whose_span_was_lost_is_not_told_to_install_itself(maf_spans, collector):
    from conftest import export_spans

    spans = run(maf_spans, make_agent(AgentSpec("solo", [Turn(50, 5)])).run(TASK))
    export_spans(collector, [s for s in spans if not s.name.startswith("agent_response")])
    (solo,) = collector.run(format(spans[0].context.trace_id, "032x"))["executors"]
    assert solo["no_truth_reason"] == "ledger_derived"
    assert "and active, but no agent_response span of this agent reached the collector" in solo["no_truth_fix"]
    assert "install opentelemetry-instrumentation-maf-fidelity" not in solo["no_truth_fix"]
