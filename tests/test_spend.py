"""What the divergence costs (docs/outputs.md "Spend"), as a user meets it: real MAF workflows on scripted
chat clients naming a known model, an unknown one and an overridden one, sent to a collector; the
figures in the run document, `runs show`, the spend counters, and pricing with no network."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timezone
from pathlib import Path

import jsonschema
import pytest

from collector.bridge import FidelityBridge
from collector.config import CollectorConfig
from collector.core.model import ChatTurn, Usage
from collector.demo.maf_fakes import AgentSpec, Turn, chain, keep_last_call_usage, lookup
from collector.ui.watch import run_line

from conftest import AGENTEVAL, CollectorProcess, export_spans
from test_run_page import _screenshot, browser, page  # the run page's Chromium fixtures

#: OpenAI's published price of gpt-4o-mini (https://openai.com/api/pricing): USD per million tokens.
GPT_4O_MINI_INPUT, GPT_4O_MINI_OUTPUT = 0.15, 0.60
#: A self-hosted model priced by hand in the config, and its rate.
LOCAL_MODEL, LOCAL_RATE = "llama3.2:3b", (0.0, 0.0)
TUNED_MODEL, TUNED_RATE = "contoso-gpt4o-prod", (2.5, 10.0)
#: The user's trace backend (answered by the browser test itself: nothing listens there).
TRACE_URL = "http://traces.test/trace/{trace_id}?span={span_id}"
#: The writer's tool loop: two calls; the framework keeps only the last one's usage (under-reports).
LOOP = [Turn(90_000, 12_000, "tool_calls", tool_call="lookup"), Turn(110_000, 16_000)]


def usd(input_tokens: int, output_tokens: int, rate: tuple[float, float]) -> float:
    return (input_tokens * rate[0] + output_tokens * rate[1]) / 1e6


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    overrides = {"pricing": {"models": {
        LOCAL_MODEL: {"input_per_mtok": LOCAL_RATE[0], "output_per_mtok": LOCAL_RATE[1], "provider": "ollama"},
        TUNED_MODEL: {"input_per_mtok": TUNED_RATE[0], "output_per_mtok": TUNED_RATE[1]}}}}
    overrides["ui"] = {"trace_url": TRACE_URL}
    proc = CollectorProcess(tmp_path_factory.mktemp("spend"), overrides)
    yield proc
    proc.stop()


@pytest.fixture(autouse=True)
def _telemetry(maf_spans):
    global MAF_SPANS
    MAF_SPANS = maf_spans


def run_maf(workflow) -> tuple[list, str]:
    """Run a real MAF workflow, on a thread of its own: a browser test's Playwright holds this one's loop."""
    bridge = FidelityBridge()
    MAF_SPANS.clear()
    with ThreadPoolExecutor(1) as thread:
        thread.submit(lambda: asyncio.run(bridge.run(workflow, "Write a short report."))).result()
    return list(MAF_SPANS.get_finished_spans()), bridge.last_trace_id


def _sent(site, workflow) -> dict:
    spans, trace_id = run_maf(workflow)
    export_spans(site, spans)
    return site.run(trace_id)


def test_a_real_maf_run_is_priced_to_the_cent_with_the_spend_the_framework_did_not_report(site):
    run = _sent(site, chain("spend-known", [
        AgentSpec("researcher", [Turn(40_000, 5_000)]),
        AgentSpec("writer", LOOP, tools=[lookup], middleware=[keep_last_call_usage()])]))
    units = {e["executor_id"]: e["evidence"] for e in run["executors"]}
    writer, researcher = units["writer"]["cost"], units["researcher"]["cost"]
    rate = (GPT_4O_MINI_INPUT, GPT_4O_MINI_OUTPUT)
    truth, framework = usd(200_000, 28_000, rate), usd(110_000, 16_000, rate)  # $0.0468 and $0.0261
    assert writer["model"] == "gpt-4o-mini (openai)"
    assert writer["truth_usd"] == pytest.approx(truth, abs=1e-9)
    assert writer["framework_usd"] == pytest.approx(framework, abs=1e-9)
    assert writer["unreported_usd"] == pytest.approx(truth - framework, abs=1e-9)  # $0.0207
    assert (writer["unreported_tokens"], writer["unknown"]) == (228_000 - 126_000, None)
    assert writer["priced_by"].startswith("genai-prices ") and writer["priced_by"].endswith("openai gpt-4o-mini")
    assert (researcher["truth_usd"], researcher["unreported_usd"], researcher["unreported_tokens"]) == (
        pytest.approx(usd(40_000, 5_000, rate), abs=1e-9), 0.0, 0)
    assert run["spend"] == {"framework_usd": pytest.approx(framework + usd(40_000, 5_000, rate), abs=1e-9),
                            "truth_usd": pytest.approx(truth + usd(40_000, 5_000, rate), abs=1e-9),
                            "unreported_usd": pytest.approx(truth - framework, abs=1e-9),
                            "unreported_tokens": 102_000, "units_priced": 2, "units_unknown": 0}
    schema = json.loads(
        (Path(__file__).resolve().parent.parent / "collector/formats/schemas/run.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(site.store().get_run(run["run_id"]))
    # what `runs show` prints, to the cent
    shown = subprocess.run([AGENTEVAL, "runs", "show", run["run_id"], "--store", site.store_url],
                           capture_output=True, text=True, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "unreported spend $0.02 (102,000 tokens)" in shown.stdout
    assert "framework $0.04, truth $0.06" in shown.stdout  # $0.0351 and $0.0558 with the researcher


def test_the_price_used_is_genai_prices_own_published_rate():
    """The test's rates are gpt-4o-mini's as genai-prices' bundled data records them (read, not computed)."""
    from genai_prices import data_snapshot

    (openai,) = [p for p in data_snapshot.get_snapshot().providers if p.id == "openai"]
    (model,) = [m for m in openai.models if m.id == "gpt-4o-mini"]
    prices = model.prices if not isinstance(model.prices, list) else model.prices[-1].prices
    assert (float(prices.input_mtok), float(prices.output_mtok)) == (GPT_4O_MINI_INPUT, GPT_4O_MINI_OUTPUT)


def test_an_unknown_model_has_an_unknown_cost_never_zero(site):
    run = _sent(site, chain("spend-unknown", [
        AgentSpec("researcher", [Turn(40_000, 5_000)]),
        AgentSpec("writer", LOOP, tools=[lookup], middleware=[keep_last_call_usage()], model="acme-llm-7")]))
    writer = next(e for e in run["executors"] if e["executor_id"] == "writer")["evidence"]["cost"]
    assert (writer["truth_usd"], writer["framework_usd"], writer["unreported_usd"]) == (None, None, None)
    assert writer["unreported_tokens"] == 102_000  # the tokens are still known
    assert "does not know model 'acme-llm-7'" in writer["unknown"] and "pricing.models" in writer["unknown"]
    rate = (GPT_4O_MINI_INPUT, GPT_4O_MINI_OUTPUT)
    assert run["spend"]["truth_usd"] == pytest.approx(usd(40_000, 5_000, rate), abs=1e-9)  # the known unit only
    assert (run["spend"]["units_priced"], run["spend"]["units_unknown"]) == (1, 1)
    shown = subprocess.run([AGENTEVAL, "runs", "show", run["run_id"], "--store", site.store_url],
                           capture_output=True, text=True, check=False)
    assert "1 unit's cost unknown" in shown.stdout and "acme-llm-7" in shown.stdout


def test_overridden_models_are_priced_at_the_configured_rate(site):
    run = _sent(site, chain("spend-override", [
        AgentSpec("researcher", [Turn(40_000, 5_000)], model=LOCAL_MODEL, provider="ollama"),
        AgentSpec("writer", LOOP, tools=[lookup], middleware=[keep_last_call_usage()], model=TUNED_MODEL,
                  provider="azure.ai.openai")]))
    units = {e["executor_id"]: e["evidence"]["cost"] for e in run["executors"]}
    assert (units["researcher"]["truth_usd"], units["researcher"]["priced_by"]) == (0.0,
                                                                                    f"pricing.models.{LOCAL_MODEL}")
    writer = units["writer"]
    assert writer["truth_usd"] == pytest.approx(usd(200_000, 28_000, TUNED_RATE), abs=1e-9)  # $0.78
    assert writer["unreported_usd"] == pytest.approx(usd(90_000, 12_000, TUNED_RATE), abs=1e-9)  # $0.345
    assert run["spend"]["units_unknown"] == 0


def test_a_self_hosted_model_without_an_override_is_unknown_not_a_hosted_price():
    from collector.outputs.pricing import Pricing

    quote = Pricing(CollectorConfig().pricing)("llama3.2", "ollama", Usage(1000, 100), None)
    assert quote.usd is None and "self-hosted" in quote.by and "pricing.models" in quote.by


def test_azure_openai_is_priced_by_its_response_model_and_a_deployment_name_is_unknown():
    from collector.outputs.pricing import Pricing

    pricing = Pricing(CollectorConfig().pricing)
    rate = (GPT_4O_MINI_INPUT, GPT_4O_MINI_OUTPUT)
    assert pricing("gpt-4o-mini-2024-07-18", "azure.ai.openai", Usage(1000, 100), None).usd == pytest.approx(
        usd(1000, 100, rate), abs=1e-12)
    deployment = pricing("contoso-prod-deployment", "azure.ai.openai", Usage(1000, 100), None)
    assert deployment.usd is None and "deployment" in deployment.by


def test_pricing_makes_no_network_call(monkeypatch):
    """Every socket connection refused: pricing still answers, from the bundled data."""
    from collector.outputs.pricing import Pricing

    def refuse(*args, **kwargs):
        raise AssertionError("pricing opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    quote = Pricing(CollectorConfig().pricing)("claude-3-5-sonnet-latest", "anthropic", Usage(1_000_000, 0), None)
    assert quote.usd == pytest.approx(3.0)


def test_a_unit_whose_calls_used_several_models_prices_its_truth_and_says_why_not_the_framework():
    from collector.core.model import ExecutorRecord, LedgerEntry
    from collector.core.reconcile import reconcile_executor
    from collector.core.spend import price_unit
    from collector.outputs.pricing import Pricing

    record = ExecutorRecord("writer", ledger=(LedgerEntry(Usage(100, 10), "stop"),), turns=(
        ChatTurn(Usage(1000, 100), "tool_calls", model="gpt-4o-mini", provider="openai"),
        ChatTurn(Usage(1000, 100), "stop", model="gpt-4o", provider="openai")), ledger_source="AgentResponseEvent")
    cost = price_unit(reconcile_executor(record).evidence, Pricing(CollectorConfig().pricing))
    assert cost.truth_usd == pytest.approx(usd(1000, 100, (0.15, 0.6)) + usd(1000, 100, (2.5, 10.0)), abs=1e-12)
    assert cost.framework_usd is None and cost.unreported_usd is None and "2 models" in cost.unknown


def test_the_run_page_leads_with_the_unreported_spend_and_links_ids_to_the_trace_backend(site, page, tmp_path):
    run = _sent(site, chain("nightly-report", [
        AgentSpec("researcher", [Turn(40_000, 5_000)]),
        AgentSpec("writer", LOOP, tools=[lookup], middleware=[keep_last_call_usage()]),
        AgentSpec("reviewer", [Turn(30_000, 2_000)], model="acme-llm-7")]))
    page.goto(f"{site.http}/runs/{run['run_id']}")
    spend = page.locator("#spend")
    assert spend.locator(".spend-figure").inner_text() == "$0.02"  # $0.0207, to the cent
    assert "102,000 tokens" in spend.inner_text() and "1 unit(s) of unknown cost are in no sum" in spend.inner_text()
    cells = {name: page.locator(f'#executors tr[data-executor="{name}"] td.cost') for name in ("writer", "reviewer")}
    assert cells["writer"].inner_text() == "$0.02"
    assert cells["reviewer"].inner_text() == "$0.00"  # it reported all it used: nothing unreported, whatever the price
    writer = page.locator('details[data-unit="writer"]')
    assert writer.locator("tr.cost td").inner_text() == "$0.03 / $0.05"  # $0.0261 and $0.0468, to the cent
    reviewer = page.locator('details[data-unit="reviewer"]')
    reviewer.locator("summary").click()
    assert "does not know model 'acme-llm-7'" in reviewer.locator("tr.cost-unknown td").inner_text()
    assert reviewer.locator("tr.cost td").inner_text() == "unknown / unknown"
    _screenshot(page, "run-page-spend.png", tmp_path)
    # every span id links into the configured backend; following one opens it
    writer_unit = run["executors"][[e["executor_id"] for e in run["executors"]].index("writer")]
    chat_span = writer_unit["evidence"]["chat_span_ids"][0]
    target = TRACE_URL.format(trace_id=run["trace_id"], span_id=chat_span)
    page.route("http://traces.test/**",
               lambda route: route.fulfill(body="the trace backend", content_type="text/plain"))
    link = writer.get_by_role("link", name=chat_span, exact=True)
    assert link.get_attribute("href") == target
    link.click()
    page.wait_for_url(target)
    assert page.locator("body").inner_text() == "the trace backend"


def test_without_a_trace_url_ids_stay_plain_text(site, page, tmp_path):
    run = _sent(site, chain("plain-ids", [AgentSpec("researcher", [Turn(400, 50)])]))
    plain = CollectorProcess(tmp_path, store_url=site.store_url)
    try:
        page.goto(f"{plain.http}/runs/{run['run_id']}")
        assert page.locator("#trace-id").inner_text() == run["trace_id"]
        assert page.locator("#trace-id a").count() == 0 and page.locator('a[href*="traces.test"]').count() == 0
        assert page.locator(".id", has_text=run["executors"][0]["evidence"]["chat_span_ids"][0]).count() >= 1
    finally:
        plain.stop()


def test_watch_shows_the_unreported_spend_of_each_run(site):
    from rich.console import Console

    from collector.ui.watch import Board, run_line

    run = site.store().get_run(_sent(site, chain("watched", [
        AgentSpec("writer", LOOP, tools=[lookup], middleware=[keep_last_call_usage()])]))["run_id"])
    assert "unreported_usd=0.020700  unreported_tokens=102000" in run_line(run)
    board = Board(rows=3)
    board.add(run)
    console = Console(record=True, width=180, color_system=None)
    console.print(board.render())
    row = next(line for line in console.export_text().splitlines() if "watched" in line)
    assert "$0.02" in row


@pytest.mark.parametrize(("model", "provider", "provider_id"), [
    ("gpt-4o-mini", "openai", "openai"), ("claude-3-5-sonnet-latest", "anthropic", "anthropic"),
    ("gemini-1.5-flash", "gcp.gemini", "google"),  # tiered: a higher rate past a prompt size
    ("deepseek-chat", "deepseek", "deepseek"), ("gpt-4o-mini-2024-07-18", "azure.ai.openai", "azure")])
def test_each_call_is_priced_as_genai_prices_own_calculation_prices_it(model, provider, provider_id):
    """The collector applies a price's rates instead of genai-prices' slow calculation per call: the
    same figures, below and past a tier, on several dates."""
    import genai_prices

    from collector.outputs.pricing import Pricing

    pricing = Pricing(CollectorConfig().pricing)
    for input_tokens, output_tokens in ((0, 0), (1, 0), (0, 1), (90_000, 12_000), (250_000, 40_000)):
        for when in (1_720_000_000, 1_790_000_000):  # 2024-07 and 2026-09 (Unix seconds)
            ours = pricing(model, provider, Usage(input_tokens, output_tokens), when * 10**9)
            theirs = genai_prices.calc_price(
                genai_prices.Usage(input_tokens=input_tokens, output_tokens=output_tokens), model,
                provider_id=provider_id, genai_request_timestamp=datetime.fromtimestamp(when, UTC))
            assert ours.usd == pytest.approx(float(theirs.total_price), abs=1e-12), (input_tokens, output_tokens, when)


def test_the_grpc_api_carries_each_units_cost_and_the_runs_spend(site):
    import grpc

    from collector.api.v1 import fidelity_pb2 as pb
    from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
    from collector.outputs.wire import to_doc

    run = _sent(site, chain("over-grpc", [
        AgentSpec("writer", LOOP, tools=[lookup], middleware=[keep_last_call_usage()]),
        AgentSpec("reviewer", [Turn(300, 20)], model="acme-llm-7")]))
    with grpc.insecure_channel(site.grpc) as channel:
        message = FidelityServiceStub(channel).GetRun(pb.GetRunRequest(run_id=run["run_id"]), timeout=10)
    assert message.spend.unreported_usd == pytest.approx(usd(90_000, 12_000, (GPT_4O_MINI_INPUT, GPT_4O_MINI_OUTPUT)))
    assert (message.spend.units_priced, message.spend.units_unknown) == (1, 1)
    reviewer = next(e for e in message.executors if e.executor_id == "reviewer")
    assert not reviewer.evidence.cost.HasField("truth_usd") and "acme-llm-7" in reviewer.evidence.cost.unknown
    doc = to_doc(message)
    assert doc["spend"] == run["spend"]
    assert [e["evidence"]["cost"] for e in doc["executors"]] == [e["evidence"]["cost"] for e in run["executors"]]


def _show(site, run_id: str, *args: str) -> str:
    proc = subprocess.run([AGENTEVAL, "runs", "show", run_id, "--store", site.store_url, *args],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_run_without_a_ledger_shows_its_spend_unknown_never_zero(site):
    """An app without the instrumentation: the chat calls are priced, the framework's side and the
    unreported spend are not known. `runs show` printed `framework $0.00 ... unreported spend $0.00
    (0 tokens)`, JUnit `unreported_usd value="0.0"`."""
    spans, trace_id = run_maf(chain("spend-no-ledger", [AgentSpec("researcher", [Turn(40_000, 5_000)]),
                                                        AgentSpec("writer", LOOP, tools=[lookup])]))
    export_spans(site, [s for s in spans if "fidelity.ledger.source" not in (s.attributes or {})])
    run = site.run(trace_id)
    assert run["status"] == "PENDING" and run["spend"]["units_priced"] == 2
    table = _show(site, run["run_id"])
    assert "spend  framework unknown, truth $0.06, unreported spend unknown (not compared)" in table
    markdown = _show(site, run["run_id"], "--format", "markdown")
    assert "framework unknown, truth $0.06, unreported spend unknown (not compared)" in markdown
    junit = _show(site, run["run_id"], "--format", "junit")
    assert '<property name="unreported_usd" value="unknown" />' in junit
    assert '<property name="unreported_tokens" value="unknown" />' in junit
    page = urllib.request.urlopen(f"{site.http}/runs/{run['run_id']}", timeout=10).read().decode()
    spend = re.search(r'<p id="spend".*?</p>', page, re.S)[0]
    assert "unknown" in spend and "$0.00" not in spend
    for text in (table, markdown, junit, spend):
        # (a run or trace id may begin with 0: only a spend property's value counts)
        assert "$0.00 " not in text and "$0.00," not in text and not re.search(r'name="unreported_\w+" value="0', text)


def test_unreported_spend_of_unknown_cost_is_not_counted_as_zero(site):
    """The cost counter sums units whose cost is known; a run whose under-report has no price adds
    its tokens, never a 0 USD series."""
    run = _sent(site, chain("spend-unknown-only", [
        AgentSpec("writer", LOOP, tools=[lookup], middleware=[keep_last_call_usage()], model="acme-llm-7")]))
    assert run["spend"]["unreported_tokens"] == 102_000 and run["spend"]["units_priced"] == 0
    time.sleep(0.2)  # the metrics are recorded as the run is published, before it is stored
    series = {(name, dict(labels).get("subject")): value for (name, labels), value in site.metrics().items()}
    assert series[("agenteval_unreported_tokens_total", "spend-unknown-only")] == 102_000
    assert ("agenteval_unreported_cost_usd_total", "spend-unknown-only") not in series
    assert "unreported_usd=unknown  unreported_tokens=102000" in run_line(site.store().get_run(run["run_id"]))
