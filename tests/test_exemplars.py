"""From a number to its trace (docs/outputs.md "Exemplars"): a real MAF run sent to a collector, its
verdict counters, spend counters and histograms read back with their exemplars, by a real OpenMetrics
parser on the scrape endpoint and by a real OTLP receiver on the push."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families

from collector.bridge import FidelityBridge
from collector.demo.maf_fakes import AgentSpec, Turn, chain, keep_last_call_usage, lookup

from conftest import CollectorProcess, export_spans

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
COUNTERS = ("agenteval_runs", "agenteval_unit_verdicts", "agenteval_unreported_tokens", "agenteval_unreported_cost_usd")


@pytest.fixture(autouse=True)
def _telemetry(maf_spans):
    global MAF_SPANS
    MAF_SPANS = maf_spans


@pytest.fixture(scope="module")
def sent(tmp_path_factory, capture):
    proc = CollectorProcess(tmp_path_factory.mktemp("exemplars"), otlp_out=f"127.0.0.1:{capture.port}")
    bridge = FidelityBridge()
    MAF_SPANS.clear()
    workflow = chain("exemplar-run", [AgentSpec("researcher", [Turn(4_000, 500)]),
                                      AgentSpec("writer", [Turn(900, 120, "tool_calls", tool_call="lookup"),
                                                           Turn(1_100, 160)],
                                                tools=[lookup], middleware=[keep_last_call_usage()])])
    asyncio.run(bridge.run(workflow, "Write a short report."))
    export_spans(proc, list(MAF_SPANS.get_finished_spans()))
    run = proc.run(bridge.last_trace_id)
    yield proc, run
    proc.stop()


def _scrape(proc, accept: str | None) -> str:
    request = urllib.request.Request(proc.prometheus, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


def test_a_fresh_collector_shows_no_spend_series_before_a_run_has_one(tmp_path):
    """The spend counters' labels (subject, MAF release) are known only from runs: a series at 0
    before any run carried placeholder values (subject="", maf_release="unknown") no run has."""
    proc = CollectorProcess(tmp_path)
    try:
        samples = {s.name: s.labels for f in text_families(_scrape(proc, None)) for s in f.samples}
    finally:
        proc.stop()
    assert "agenteval_unreported_tokens_total" not in samples and "agenteval_unreported_cost_usd_total" not in samples
    assert samples["agenteval_spans_received_total"] == {"transport": "http"}  # a self-metric: at 0 from the start


def test_the_openmetrics_scrape_carries_the_runs_trace_id_on_its_verdicts(sent):
    proc, run = sent
    families = {f.name: f for f in openmetrics_families(_scrape(proc, OPENMETRICS))}
    by_name = {}
    for name in COUNTERS:
        for sample in families[name].samples:
            if sample.labels.get("subject") == "exemplar-run" and sample.name.endswith("_total"):
                by_name[name, sample.labels.get("status") or sample.labels.get("verdict")] = sample
    expected = {"trace_id": run["trace_id"], "run_id": run["run_id"]}
    fail = by_name["agenteval_runs", "FAIL"]
    assert fail.value == 1 and fail.exemplar.labels == expected
    assert by_name["agenteval_unit_verdicts", "TokenMismatch"].exemplar.labels == expected
    tokens, cost = by_name["agenteval_unreported_tokens", None], by_name["agenteval_unreported_cost_usd", None]
    assert tokens.value == 900 + 120 and tokens.exemplar.labels == expected  # the tool call's tokens went unreported
    assert cost.value == pytest.approx(run["spend"]["unreported_usd"]) and cost.exemplar.labels == expected
    assert cost.value == pytest.approx((900 * 0.15 + 120 * 0.60) / 1e6)  # gpt-4o-mini's published rates
    for histogram, value in (("agenteval_run_score", run["score"]), ("agenteval_token_delta_tokens", 1020)):
        marked = [s for s in families[histogram].samples if s.exemplar is not None and s.exemplar.labels == expected
                  and s.exemplar.value == value]
        assert len(marked) == 1  # on the bucket the run's value fell in: the smallest bound at or above it
        bounds = sorted({float(s.labels["le"]) for s in families[histogram].samples if "le" in s.labels})
        assert float(marked[0].labels["le"]) == next(b for b in bounds if b >= value)


def test_the_plain_text_scrape_has_no_exemplars_and_still_parses(sent):
    proc, _ = sent
    text = _scrape(proc, None)
    assert " # {" not in text
    assert any(f.name == "agenteval_runs" for f in text_families(text))


def test_the_otlp_push_carries_the_runs_trace_as_exemplars(sent, capture):
    proc, run = sent
    trace_id, span_id = bytes.fromhex(run["trace_id"]), bytes.fromhex(run["root_span_id"])

    def exemplars() -> dict[str, list]:
        found: dict[str, list] = {}
        for request in list(capture.metrics.requests):
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        points = (metric.sum.data_points if metric.HasField("sum")
                                  else metric.histogram.data_points if metric.HasField("histogram") else [])
                        found.setdefault(metric.name, []).extend(
                            e for p in points for e in p.exemplars if e.trace_id == trace_id)
        return found

    deadline = time.monotonic() + 15
    names = ("agenteval.runs", "agenteval.unit.verdicts", "agenteval.unreported.cost_usd", "agenteval.run.score",
             "agenteval.token.delta")
    while not all(exemplars().get(n) for n in names):
        assert time.monotonic() < deadline, f"no exemplar of the run on {[n for n in names if not exemplars().get(n)]}"
        time.sleep(0.2)
    found = exemplars()
    for name in names:
        exemplar = found[name][-1]
        assert exemplar.span_id == span_id
        assert {kv.key: kv.value.string_value for kv in exemplar.filtered_attributes} == {"run_id": run["run_id"]}
    # the run id is an exemplar's, never a label: no series per run
    for request in capture.metrics.requests:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.HasField("sum"):
                        assert all(kv.key != "run_id" for p in metric.sum.data_points for kv in p.attributes)
