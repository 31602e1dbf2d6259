"""The live collector end to end: real OTLP exporters in, stored runs / verdict spans / metrics out."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import time
import urllib.request
from datetime import datetime

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.store import unpack

from conftest import AGENTEVAL, CollectorProcess, export_spans, post, verdicts
from mafshape import SCENARIOS, Invocation, Scenario, export_request, ok, record, sent_times, to_otlp_json


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_maf_python_shaped_workflow_gets_its_verdict_over_grpc(collector, capture, name):
    scenario, status, expected = SCENARIOS[name]
    spans, (trace_id,) = record([scenario])
    export_spans(collector, spans)
    run = collector.run(trace_id)
    assert run["status"] == status and verdicts(run) == expected
    assert run["source"] == "live" and run["revision"] == 1 and not run["incomplete"]
    assert run["subject"] == scenario.name
    if status == "PENDING":
        assert run["score"] is None
    # Verdict spans sit in the source trace, under the workflow root, linked to the executor spans.
    (run_span,) = capture.wait_spans(trace_id, "fidelity.run", 1)
    root = next(s for s in spans if s.parent is None)
    assert run_span.parent_span_id == root.context.span_id.to_bytes(8, "big")
    attrs = {kv.key: kv.value for kv in run_span.attributes}
    assert attrs["fidelity.status"].string_value == status
    assert ("fidelity.score" in attrs) == (status != "PENDING")
    children = capture.wait_spans(trace_id, "fidelity.executor", len(expected))
    assert {c.parent_span_id for c in children} == {run_span.span_id}
    executor_span_ids = {s.context.span_id.to_bytes(8, "big") for s in spans if s.name.startswith("executor.process")}
    for child in children:
        cattrs = {kv.key: kv.value for kv in child.attributes}
        eid = cattrs["fidelity.executor.id"].string_value
        assert cattrs["fidelity.verdict"].string_value == expected[eid]
        evidence = next(e["evidence"] for e in run["executors"] if e["executor_id"] == eid)
        # linked to every executor span of the unit (a looped one: each pass), named by its run
        linked = {link.span_id for link in child.links}
        assert linked and linked <= executor_span_ids
        assert linked == {bytes.fromhex(s) for s in evidence["executor_span_ids"]}
        assert cattrs["fidelity.run_id"].string_value == run["run_id"]
        assert cattrs["fidelity.subject"].string_value == scenario.name
        for attr, key in (("fidelity.framework.tokens", "framework_tokens"), ("fidelity.truth.tokens", "truth_tokens"),
                          ("fidelity.delta", "delta")):
            assert (cattrs[attr].int_value if attr in cattrs else None) == evidence[key], (eid, attr)


def test_a_run_says_when_it_started_and_how_long_it_took(collector):
    """An SRE debugging a FAIL: the run document (the store, /runs/{id}.json, the gRPC API) carries
    the run's start and duration, from the spans, whichever decoder read them (the compiled one for
    OTLP protobuf, the OTLP/JSON one for JSON)."""
    spans, ids = record([SCENARIOS["fail_under_report"][0], SCENARIOS["pass"][0]])
    by_grpc = [s for s in spans if format(s.context.trace_id, "032x") == ids[0]]
    export_spans(collector, by_grpc)
    body = json.dumps(to_otlp_json(export_request([s for s in spans if s not in by_grpc]))).encode()
    assert post(collector.http, body, "application/json")[0] == 200
    with grpc.insecure_channel(collector.grpc) as channel:
        for trace_id in ids:
            run = collector.run(trace_id)
            started, duration = sent_times(spans, trace_id)
            assert run["started_at"].endswith(("Z", "+00:00"))  # said in UTC
            assert datetime.fromisoformat(run["started_at"]) == started
            assert run["duration_s"] == pytest.approx(duration, abs=1e-9) and run["duration_s"] > 0
            with urllib.request.urlopen(f"{collector.http}/runs/{run['run_id']}.json", timeout=10) as resp:
                served = json.load(resp)
            assert (served["started_at"], served["duration_s"]) == (run["started_at"], run["duration_s"])
            got = FidelityServiceStub(channel).GetRun(pb.GetRunRequest(run_id=run["run_id"]), timeout=10)
            assert (got.started_at, got.duration_s) == (run["started_at"], run["duration_s"])


def test_a_unit_never_compared_has_no_difference_on_its_verdict_span(collector, capture):
    """MAF Python without the instrumentation: the unit's span said framework tokens 0 and delta -600
    "under", which a backend counting under-reports by direction counted."""
    spans, (trace_id,) = record([Scenario({"writer": [Invocation([ok(420, 180)])]}, name="derived",
                                          ledger="invoke_agent")])
    export_spans(collector, spans)
    assert collector.run(trace_id)["status"] == "PENDING"
    (child,) = capture.wait_spans(trace_id, "fidelity.executor", 1)
    attrs = {kv.key: kv.value for kv in child.attributes}
    assert attrs["fidelity.verdict"].string_value == "NoTruth" and attrs["fidelity.truth.tokens"].int_value == 600
    assert attrs["fidelity.no_truth.reason"].string_value == "ledger_derived"
    assert not {"fidelity.framework.tokens", "fidelity.delta", "fidelity.direction",
                "fidelity.framework.finish_reason"} & set(attrs)


def test_path2_reasons_are_counted_in_metrics(collector):
    before = collector.metrics()
    spans, (trace_id,) = record([SCENARIOS["path2_pending"][0]])
    export_spans(collector, spans)
    run = collector.run(trace_id)
    assert {e["no_truth_reason"] for e in run["executors"]} == {"response_missing"}
    after = collector.metrics()
    key = ("agenteval_notruth_units_total", (("reason", "response_missing"), ("subject", "path2")))
    assert after[key] - before.get(key, 0) == 2
    runs_key = ("agenteval_runs_total", (("status", "PENDING"), ("subject", "path2")))
    assert after[runs_key] - before.get(runs_key, 0) == 1


def test_metrics_expose_verdicts_scores_and_self_metrics(collector):
    spans, (trace_id,) = record([SCENARIOS["fail_under_report"][0]])
    export_spans(collector, spans, "http")
    collector.run(trace_id)
    m = collector.metrics()
    names = {name for name, _ in m}
    for expected in ("agenteval_runs_total", "agenteval_unit_verdicts_total", "agenteval_run_score_bucket",
                     "agenteval_token_delta_tokens_bucket", "agenteval_spans_received_total",
                     "agenteval_traces_in_flight", "agenteval_spans_in_flight",
                     "agenteval_verdict_latency_seconds_bucket"):
        assert expected in names, expected
    # no MAF instrumentation announced a release: no maf_release label
    assert m[("agenteval_unit_verdicts_total", (("subject", "fail-under-report"), ("verdict", "TokenMismatch")))] >= 1
    assert m[("agenteval_spans_received_total", (("transport", "http"),))] >= len(spans)


def test_fidelity_counters_say_which_workflow_up_to_a_bound(tmp_path):
    """Ops watch FAIL and PENDING rates per workflow: the counters carried only status / verdict /
    reason. The first `metric_subjects` subjects get their own label, later ones `_other`."""
    proc = CollectorProcess(tmp_path, {"exporters": {"metric_subjects": 2}})
    try:
        for name in ("fail_under_report", "path2_pending", "pass", "finish_mismatch"):  # one after another
            spans, (trace_id,) = record([SCENARIOS[name][0]])
            export_spans(proc, spans)
            proc.run(trace_id)
        runs = {labels: v for (name, labels), v in proc.metrics().items() if name == "agenteval_runs_total" and v}
        # no MAF instrumentation announced a release: no maf_release label (never a placeholder value)
        assert runs == {(("status", "FAIL"), ("subject", "fail-under-report")): 1,
                        (("status", "PENDING"), ("subject", "path2")): 1,
                        (("status", "PASS"), ("subject", "_other")): 1,
                        (("status", "WARN"), ("subject", "_other")): 1}
        verdicts = {labels: v for (name, labels), v in proc.metrics().items()
                    if name == "agenteval_unit_verdicts_total"}
        assert verdicts[(("subject", "fail-under-report"), ("verdict", "TokenMismatch"))] == 1
        assert verdicts[(("subject", "_other"), ("verdict", "FinishMismatch"))] == 1
    finally:
        proc.stop()


def test_http_json_with_hex_ids_and_integer_enums(collector):
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    body = json.dumps(to_otlp_json(export_request(spans))).encode()
    status, payload, headers = post(collector.http, body, "application/json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(payload) == {}
    assert collector.run(trace_id)["status"] == "PASS"


def test_http_gzip_protobuf(collector):
    spans, (trace_id,) = record([SCENARIOS["loop"][0]])
    body = gzip.compress(export_request(spans).SerializeToString())
    status, payload, _ = post(collector.http, body, "application/x-protobuf", {"Content-Encoding": "gzip"})
    assert status == 200
    assert ExportTraceServiceResponse.FromString(payload).partial_success.rejected_spans == 0
    assert collector.run(trace_id)["status"] == "PASS"


def test_duplicate_delivery_is_counted_once(collector):
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    before = collector.metrics()
    export_spans(collector, spans)
    export_spans(collector, spans)  # an exporter retry
    run = collector.run(trace_id)
    evidence = {e["executor_id"]: e["evidence"] for e in run["executors"]}
    assert evidence["writer"]["truth_tokens"] == 960 and evidence["writer"]["response_turns"] == 2
    after = collector.metrics()
    key = ("agenteval_spans_duplicate_total", (("transport", "grpc"),))
    assert after[key] - before.get(key, 0) == len(spans)


def test_one_trace_split_over_many_requests_and_both_transports(collector):
    spans, (trace_id,) = record([SCENARIOS["fail_under_report"][0]])
    for i, span in enumerate(spans):  # children first, as exporters send them
        export_spans(collector, [span], "grpc" if i % 2 else "http")
    run = collector.run(trace_id)
    assert run["status"] == "FAIL" and verdicts(run)["writer"] == "TokenMismatch"


def test_late_span_produces_revision_2(collector, capture):
    scenario = Scenario({"researcher": [Invocation([ok(420, 180)])],
                         "writer": [Invocation([ok(300, 120, "tool_calls"), ok(310, 230)])]}, name="late")
    spans, (trace_id,) = record([scenario])
    late = [s for s in spans if s.name.startswith("chat") and s.attributes.get("gen_ai.usage.input_tokens") == 300]
    export_spans(collector, [s for s in spans if s not in late])
    first = collector.run(trace_id)
    assert first["revision"] == 1
    assert next(e for e in first["executors"] if e["executor_id"] == "writer")["evidence"]["truth_tokens"] == 540
    export_spans(collector, late)
    second = collector.run(trace_id, revision=2)
    writer = next(e for e in second["executors"] if e["executor_id"] == "writer")
    assert writer["evidence"]["truth_tokens"] == 960 and second["status"] == "PASS"
    runs = [s for s in capture.wait_spans(trace_id, "fidelity.run", 2)]
    assert sorted(next(kv.value.int_value for kv in s.attributes if kv.key == "fidelity.revision")
                  for s in runs) == [1, 2]


def test_trace_without_root_is_finalized_after_max_trace_wait_and_flagged_incomplete(collector):
    """Every unit that arrived agrees, but units whose spans never arrived were not checked: the
    pass is withheld (it was a PASS 1.000 after a kill -9 had lost most of a trace)."""
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    export_spans(collector, [s for s in spans if s.parent is not None])
    run = collector.run(trace_id, timeout=10)
    assert run["incomplete"] is True
    assert verdicts(run) == {"researcher": "Agree", "writer": "Agree"}
    assert (run["status"], run["score"]) == ("WARN", 1.0)
    assert run["coverage_note"] == "the trace is incomplete; a pass on the 2 unit(s) that arrived is withheld"
    listed = subprocess.run([AGENTEVAL, "runs", "list", "--store", str(collector.store_path)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "COLUMNS": "250"}).stdout.splitlines()
    row = next(i for i, line in enumerate(listed) if trace_id in line)
    assert "WARN" in listed[row] and "incomplete" in listed[row + 1]  # marked in the list too


def test_dotnet_shaped_workflow(collector):
    scenario = Scenario({"planner": [Invocation([ok(100, 20)])],
                         "coder": [Invocation([ok(300, 200, "length")], reported=(300, 200, "stop"))]},
                        name="dotnet", dotnet=True)
    spans, (trace_id,) = record([scenario])
    export_spans(collector, spans)
    run = collector.run(trace_id)
    assert verdicts(run) == {"planner": "Agree", "coder": "FinishMismatch"}


def _direct_agent_call(language: str) -> tuple[list, str]:
    """An agent called outside any workflow (.NET orchestration builders emit no workflow spans):
    the agent reports 15 tokens, its chat call used 150."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"telemetry.sdk.language": language}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent_framework")
    with tracer.start_as_current_span("invoke_agent helper", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper",
            "gen_ai.usage.input_tokens": 10, "gen_ai.usage.output_tokens": 5,
            "gen_ai.response.finish_reasons": '["stop"]'}) as root, tracer.start_as_current_span("chat m", attributes={
            "gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 100, "gen_ai.usage.output_tokens": 50,
            "gen_ai.response.finish_reasons": '["stop"]'}):
        pass
    return list(exporter.get_finished_spans()), format(root.get_span_context().trace_id, "032x")


def test_direct_dotnet_agent_call_is_one_run_and_its_under_report_is_caught(collector):
    spans, trace_id = _direct_agent_call("dotnet")
    export_spans(collector, spans)
    run = collector.run(trace_id)
    assert run["run_id"] == trace_id  # no workflow-run span: the run is the trace
    (helper,) = run["executors"]
    assert helper["executor_id"] == "helper" and helper["verdict"] == "TokenMismatch"
    assert (helper["evidence"]["framework_tokens"], helper["evidence"]["truth_tokens"]) == (15, 150)
    assert helper["evidence"]["ledger_source"] == "invoke_agent" and run["status"] == "FAIL"


def test_python_invoke_agent_usage_is_never_taken_as_the_ledger(collector):
    # MAF Python re-sums invoke_agent's usage from its chat spans: comparing them proves nothing.
    spans, trace_id = _direct_agent_call("python")
    export_spans(collector, spans)
    run = collector.run(trace_id)
    (helper,) = run["executors"]
    assert (helper["verdict"], helper["no_truth_reason"]) == ("NoTruth", "ledger_derived")
    assert run["status"] == "PENDING" and run["score"] is None
    assert "MafFidelityInstrumentor" in helper["no_truth_fix"]


def test_invalid_spans_are_rejected_in_partial_success_and_the_rest_kept(collector):
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    doc = to_otlp_json(export_request(spans))
    bad = dict(doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0])
    bad["spanId"] = "abc"  # wrong length
    bad["name"] = "broken"
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"].append(bad)
    status, payload, _ = post(collector.http, json.dumps(doc).encode(), "application/json")
    assert status == 200
    partial = json.loads(payload)["partialSuccess"]
    assert int(partial["rejectedSpans"]) == 1 and "spanId" in partial["errorMessage"]
    assert collector.run(trace_id)["status"] == "PASS"


def test_undecodable_requests_get_400_and_invalid_argument(collector):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

    status, payload, _ = post(collector.http, b"\xff\xfe not protobuf", "application/x-protobuf")
    assert status == 400
    status, payload, _ = post(collector.http, b"{not json", "application/json")
    assert status == 400 and "decode" in json.loads(payload)["message"]
    status, _, _ = post(collector.http, b"{}", "text/plain")
    assert status == 415
    status, _, _ = post(collector.http, b"not gzip", "application/x-protobuf", {"Content-Encoding": "gzip"})
    assert status == 400
    logged = [(e["status"], e["content_type"]) for e in collector.log_events()
              if e.get("event") == "request_invalid" and e["transport"] == "http"][-4:]
    assert logged == [(400, "application/x-protobuf"), (400, "application/json"), (415, "text/plain"),
                      (400, "application/x-protobuf")]  # each one logged, as the client's error
    metrics = collector.metrics()  # counted as requests, not as spans (they hold none we could read)
    assert metrics[("agenteval_requests_rejected_total", (("reason", "undecodable"), ("transport", "http")))] >= 4
    assert {dict(labels)["reason"] for name, labels in metrics if name == "agenteval_spans_rejected_total"} <= \
        {"invalid_span", "late", "never_fits"}  # spans only
    channel = grpc.insecure_channel(collector.grpc)
    raw = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xfe\xfd garbage", timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert TraceServiceStub(channel)  # the real stub and raw bytes hit the same service
    channel.close()


def test_our_own_verdict_spans_are_never_reingested(collector, capture):
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    export_spans(collector, spans)
    collector.run(trace_id)
    (run_span,) = capture.wait_spans(trace_id, "fidelity.run", 1)
    before = collector.metrics()
    # Loop the exported verdict spans straight back in, as a mis-pointed pipeline would.
    own = [req for req in list(capture.requests) if any(
        s.trace_id.hex() == trace_id for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)]
    for req in own:
        status, _, _ = post(collector.http, req.SerializeToString(), "application/x-protobuf")
        assert status == 200
    after = collector.metrics()
    key = ("agenteval_spans_received_total", (("transport", "http"),))
    assert after.get(key, 0) == before.get(key, 0)
    own = ("agenteval_spans_own_total", (("transport", "http"),))
    assert after[own] - before.get(own, 0) >= 1 + 2  # fidelity.run and its executor spans
    assert collector.run(trace_id)["revision"] == 1


def test_offline_cli_and_live_collector_give_the_same_verdicts(collector, tmp_path):
    from test_cli import bench

    scenarios = [SCENARIOS[n][0] for n in ("fail_under_report", "finish_mismatch", "path2_pending", "partial_warn")]
    spans, ids = record(scenarios)
    export_spans(collector, spans)
    path = tmp_path / "same.jsonl"
    path.write_text(json.dumps(to_otlp_json(export_request(spans))) + "\n")
    offline = {r["trace_id"]: r for r in json.loads(bench(path, tmp_path / "o.db", "--json").stdout)["runs"]}
    for trace_id in ids:
        live = collector.run(trace_id)
        assert [(e["executor_id"], e["verdict"], e["score"], e["no_truth_reason"], e["evidence"])
                for e in live["executors"]] \
            == [(e["executor_id"], e["verdict"], e["score"], e["no_truth_reason"], e["evidence"])
                for e in offline[trace_id]["executors"]]
        assert (live["status"], live["score"]) == (offline[trace_id]["status"], offline[trace_id]["score"])


def test_prompt_and_response_text_is_never_stored_logged_or_exported(collector, capture):
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    assert any("SECRET-PROMPT" in str(s.attributes) for s in spans)  # the input really carries content
    export_spans(collector, spans, "http")
    collector.run(trace_id)
    capture.wait_spans(trace_id, "fidelity.executor", 2)
    stored = b"".join(p.read_bytes() for p in collector.store_path.parent.rglob("runs.db*")
                      if p.is_file())  # the store, its WAL and the crash journal's segments
    logged = collector.stderr_path.read_text()
    exported = b"".join(req.SerializeToString() for req in list(capture.requests))
    for secret in ("SECRET-PROMPT", "SECRET-ANSWER"):
        assert secret.encode() not in stored and secret not in logged and secret.encode() not in exported


def test_sigterm_finalizes_in_flight_traces_as_incomplete_and_exits_0(tmp_path):
    from conftest import CollectorProcess

    proc = CollectorProcess(tmp_path, overrides={"assembly": {"quiet_period": 60, "max_trace_wait": 600}})
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    export_spans(proc, [s for s in spans if s.parent is not None])  # the root never arrives
    assert proc.stop() == 0
    con = __import__("sqlite3").connect(proc.store_path)
    (body,) = con.execute("SELECT body FROM runs WHERE run_id = ?", (trace_id,)).fetchone()
    run = json.loads(unpack(body))
    assert run["incomplete"] is True and verdicts(run) == {"researcher": "Agree", "writer": "Agree"}
    assert any(e.get("event") == "collector_stopped" and e["finalized_on_shutdown"] == 1 for e in proc.log_events())


def test_metrics_are_also_pushed_over_otlp(collector, capture):
    import time

    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    export_spans(collector, spans)
    collector.run(trace_id)
    deadline = time.monotonic() + 10
    while "agenteval.runs" not in capture.metrics.metric_names() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {"agenteval.runs", "agenteval.unit.verdicts", "agenteval.spans.received"} <= capture.metrics.metric_names()


def test_completion_follows_each_traces_deadline_not_a_fixed_tick(tmp_path):
    """With a sweep interval far beyond the test's wait, verdicts still come once each trace's quiet
    period ends: the first trace after an idle spell, and one arriving while another is pending."""
    proc = CollectorProcess(tmp_path, {"assembly": {"sweep_interval": 60.0, "quiet_period": 0.2}})
    try:
        first, (first_tid,) = record([SCENARIOS["pass"][0]])
        export_spans(proc, first)
        assert proc.run(first_tid, timeout=20)["status"] == "PASS"
        time.sleep(1.0)  # idle: the sweeper now sleeps towards its 60 s cap
        second, (second_tid,) = record([SCENARIOS["fail_under_report"][0]])
        third, (third_tid,) = record([SCENARIOS["loop"][0]])
        export_spans(proc, second)
        export_spans(proc, third)
        assert proc.run(second_tid, timeout=20)["status"] == "FAIL"
        assert proc.run(third_tid, timeout=20)["status"] == "PASS"
    finally:
        proc.stop()
