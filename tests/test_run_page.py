"""The run page (/runs, /runs/{id}) in real headless Chromium, plus its HTTP edges.

Set AGENTEVAL_SCREENSHOTS=docs to refresh the committed screenshots (`make screenshots`).
CI sets AGENTEVAL_REQUIRE_BROWSER=1, so a missing Chromium fails there instead of skipping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from collector.core.reconcile import reconcile
from collector.formats.loader import workflow_trace_run
from collector.store import StoredRun, pack

from conftest import AGENTEVAL, CollectorProcess, export_spans, shown_seconds
from mafshape import SCENARIOS, Call, Invocation, Scenario, export_request, ok, record, sent_times, to_otlp_json

JAEGER = "http://localhost:16686/trace/{trace_id}"
#: Jaeger's trace view with one span highlighted.
JAEGER_SPAN = "http://localhost:16686/trace/{trace_id}?uiFind={span_id}"
#: An executor id and a workflow name without a break opportunity, wider than a phone.
LONG_UNIT = "quarterly_billing_reconciliation_coordinator_executor_for_the_emea_region"
LONG_NAME = "quarterly-billing-reconciliation-workflow-with-a-rather-long-name-for-the-emea-region"
CHROMIUM = os.environ.get("AGENTEVAL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
#: Flags for a closed network: no background fetches, no sandbox (CI runs as root).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _get(url: str, headers: dict | None = None) -> tuple[int, str, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


NAMES = ["pass", "fail_under_report", "path2_pending", "partial_warn", "finish_mismatch"]


@pytest.fixture(scope="module")
def sent():
    """The spans of the shared scenarios' runs (:data:`NAMES`) and their trace ids, as sent to ``site``."""
    return record([SCENARIOS[n][0] for n in NAMES])


@pytest.fixture(scope="module")
def site(tmp_path_factory, sent):
    proc = CollectorProcess(tmp_path_factory.mktemp("page"), {"ui": {"trace_url": JAEGER}})
    spans, ids = sent
    hostile = Scenario({"w<i>": [Invocation([ok(10, 5)])]}, name="<script>alert(1)</script>")
    # a unit over the token tolerance with its finish reason suppressed (three invocations), beside a Path-2 unit
    long_ids = Scenario({LONG_UNIT: [Invocation([ok(300, 120, "tool_calls"), ok(310, 230, "content_filter")],
                                                reported=(310, 230, None))] * 3,
                         "writer": [Invocation([Call(), Call()], reported=(610, 350, "stop"))]}, name=LONG_NAME)
    # three passes of one agent, only the second's content_filter suppressed
    second_pass = Scenario({"reviewer": [Invocation([ok(400, 60)]), Invocation([ok(420, 55, "content_filter")],
                                                                                reported=(420, 55, None)),
                                         Invocation([ok(430, 20)])]}, name="second-pass")
    # MAF Python without the instrumentation: no framework ledger at all
    derived = Scenario({"writer": [Invocation([ok(420, 180)])]}, name="derived", ledger="invoke_agent")
    # a tool loop whose second call raised, both on one provider: what the per-call table shows
    per_call = Scenario({"writer": [Invocation([Call(400, 80, "tool_calls", provider="openai"),
                                                Call(error="RateLimitError", provider="openai"),
                                                Call(320, 160, "stop", provider="openai")],
                                               reported=(300, 240, "stop"))]}, name="per-call")
    # a ledger a third above its chat calls: Agree (over-reporting is not flagged by default), shown as one
    over = Scenario({"writer": [Invocation([ok(300, 150)], reported=(400, 200, "stop"))]}, name="over-report")
    more, (hostile_id, long_id, second_id, derived_id, per_call_id, over_id) = record(
        [hostile, long_ids, second_pass, derived, per_call, over])
    export_spans(proc, spans + more)
    runs = {n: proc.run(i) for n, i in zip(NAMES, ids, strict=True)}
    runs["hostile"] = proc.run(hostile_id)
    runs["long_ids"] = proc.run(long_id)
    runs["second_pass"] = proc.run(second_id)
    runs["derived"] = proc.run(derived_id)
    # `agenteval bench` stores a trace file's run under a fresh run id, apart from its trace id
    trace_file = tmp_path_factory.mktemp("bench") / "trace.json"
    trace_file.write_text(json.dumps(to_otlp_json(export_request(record([SCENARIOS["pass"][0]])[0]))))
    subprocess.run([AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace", str(trace_file),
                    "--subject", "bench"], env={**os.environ, "AGENTEVAL_STORE": proc.store_url},
                   check=True, capture_output=True, timeout=60)
    runs["bench"] = proc.store().list_runs(subject="bench", with_docs=True)[0]
    runs["per_call"] = proc.run(per_call_id)
    runs["over"] = proc.run(over_id)
    yield proc, runs
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        if os.environ.get("AGENTEVAL_REQUIRE_BROWSER"):
            pytest.fail("Chromium not found (install Debian's chromium, or set AGENTEVAL_CHROMIUM)")
        pytest.skip("Chromium not found: `apt-get install chromium` (CI installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    context.set_default_timeout(5000)
    yield context.new_page()
    context.close()


def _span_ids(run: dict) -> set[str]:
    """Every span id a run page shows: each unit's executor, ledger, chat and invocation spans."""
    ids = set()
    for e in run["executors"]:
        ev = e["evidence"]
        ids.update(ev["executor_span_ids"], ev["ledger_span_ids"], ev["chat_span_ids"])
        ids.update(f["invocation"] for f in ev["finish_comparisons"] if f["invocation"])
    return ids


def _assert_span_ids_link(page, run: dict, template: str) -> None:
    ids = _span_ids(run)
    assert len(ids) >= 4
    for span_id in ids:
        shown = page.get_by_text(span_id, exact=True)
        assert shown.count() >= 1, span_id
        for element in shown.all():
            assert element.evaluate("e => e.tagName") == "A", span_id
            assert element.get_attribute("href") == template.format(trace_id=run["trace_id"], span_id=span_id)


def _utc(proc: CollectorProcess, run: dict) -> str:
    updated = proc.store().get_run(run["run_id"])["updated_at"]
    return datetime.fromtimestamp(updated, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _screenshot(page, name: str, tmp_path: Path) -> None:
    target = Path(os.environ.get("AGENTEVAL_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target / name), full_page=True)
    assert (target / name).stat().st_size > 10_000


def test_runs_list_shows_recent_runs_and_filters_by_status(site, page):
    proc, runs = site
    page.goto(f"{proc.http}/runs")
    rows = page.locator("#runs tbody tr")
    assert rows.count() == len(runs)
    for run in runs.values():
        row = page.locator(f'tr[data-run-id="{run["run_id"]}"]')
        assert row.locator(".badge").first.inner_text() == run["status"]
    page.select_option("select[name=status]", "PENDING")
    page.click("button[type=submit]")
    page.wait_for_url("**status=PENDING**")
    pending = sorted(r["run_id"] for r in runs.values() if r["status"] == "PENDING")
    assert len(pending) == 2
    assert sorted(r.get_attribute("data-run-id") for r in page.locator("#runs tbody tr").all()) == pending


def test_fail_run_page_explains_the_token_divergence(site, page, tmp_path):
    proc, runs = site
    run = runs["fail_under_report"]
    page.goto(f"{proc.http}/runs")
    page.locator(f'tr[data-run-id="{run["run_id"]}"] a.run').click()
    page.wait_for_url(f"**/runs/{run['run_id']}")
    assert page.locator("#status").inner_text() == "FAIL"
    writer = page.locator('#executors tr[data-executor="writer"]')
    cells = [c.inner_text() for c in writer.locator("td").all()]
    assert cells[1] == "TokenMismatch" and cells[3] == "540" and cells[4] == "960"
    assert cells[5].startswith("-420") and "under" in cells[5]
    assert page.locator('#executors tr[data-executor="researcher"]').get_attribute("data-verdict") == "Agree"
    diverged = page.locator('[data-diverged="writer"]').inner_text()
    assert "reported 540 tokens" in diverged and "summed 960 over 2 chat call(s)" in diverged
    assert "43.8% under" in diverged
    assert page.locator("#trace-id a").get_attribute("href") == JAEGER.format(trace_id=run["trace_id"])
    assert "SECRET-PROMPT" not in page.content() and "SECRET-ANSWER" not in page.content()
    _screenshot(page, "run-page-fail.png", tmp_path)


def test_pending_run_page_says_why_each_executor_has_no_truth(site, page, tmp_path):
    proc, runs = site
    run = runs["path2_pending"]
    page.goto(f"{proc.http}/runs/{run['run_id'][:10]}")  # a unique prefix is enough
    assert page.locator("#status").inner_text() == "PENDING"
    assert "none of its 2 agent unit(s) could be checked" in page.locator("#summary").inner_text()
    assert "This is not a pass" in page.locator("#summary").inner_text()
    card = page.locator('[data-no-truth="response_missing"]')  # one card per reason, naming its units
    assert [u.inner_text() for u in card.locator(".unit").all()] == ["researcher", "writer"]
    assert "Path-2 gap" in card.locator(".explanation").inner_text()
    assert "InProcessExecution" in card.locator(".fix").inner_text()
    assert page.locator('#executors tr[data-executor="writer"] td').nth(9).inner_text() == "0 / 0 / 2"
    _screenshot(page, "run-page-pending.png", tmp_path)


def test_warn_page_distinguishes_no_chat_trace_from_a_finish_mismatch(site, page):
    proc, runs = site
    page.goto(f"{proc.http}/runs/{runs['partial_warn']['run_id']}")
    assert page.locator('[data-no-truth="no_chat_trace"] .unit').inner_text() == "writer"
    assert "ChatTelemetryLayer" in page.locator('[data-no-truth="no_chat_trace"] .fix').inner_text()
    page.goto(f"{proc.http}/runs/{runs['finish_mismatch']['run_id']}")
    assert page.locator('#executors tr[data-executor="reviewer"]').get_attribute("data-verdict") == "FinishMismatch"


def test_untrusted_names_are_escaped(site, page):
    proc, runs = site
    page.goto(f"{proc.http}/runs/{runs['hostile']['run_id']}")
    assert page.locator("h1").inner_text().endswith("<script>alert(1)</script>")
    assert page.locator("#executors strong").first.inner_text() == "w<i>"
    assert page.locator("script").count() == 0


def test_http_edges(site):
    proc, runs = site
    status, body, headers = _get(f"{proc.http}/runs")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert _get(f"{proc.http}/runs?status=GREEN")[0] == 400
    assert _get(f"{proc.http}/runs?limit=x")[0] == 400
    status, body, _ = _get(f"{proc.http}/runs/0000dead")
    assert status == 404 and "no run" in body
    assert str(proc.store_path) not in body and "runs.db" not in body  # a client is not told where the store is


def test_run_page_needs_the_token_when_auth_is_on_and_can_be_turned_off(tmp_path):
    token = "page-token-value"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc = CollectorProcess(tmp_path / "a", {"receivers": {"auth": {"bearer_token_env": "AGENTEVAL_TOKEN"}}},
                            env={"AGENTEVAL_TOKEN": token})
    try:
        assert _get(f"{proc.http}/runs")[0] == 401
        assert _get(f"{proc.http}/runs", {"Authorization": f"Bearer {token}"})[0] == 200
    finally:
        proc.stop()
    off = CollectorProcess(tmp_path / "b", {"receivers": {"http": {"run_page": False}}})
    try:
        assert _get(f"{off.http}/runs")[0] == 404
    finally:
        off.stop()


@pytest.mark.parametrize("width", [1366, 1100, 800, 390])
def test_pages_fit_the_window_without_sideways_scrolling(site, browser, width, tmp_path):
    """At 800 px /runs scrolled sideways (913 px: nine columns beside a run id broken only after its
    trace id), and between 720 and 1200 px so did a run page's eleven-column units table."""
    proc, runs = site
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    try:
        for path in ["/runs"] + [f"/runs/{run['run_id']}" for run in runs.values()]:
            page.goto(f"{proc.http}{path}")
            scroll, client = page.evaluate("[document.documentElement.scrollWidth, "
                                           "document.documentElement.clientWidth]")
            assert scroll <= client, f"{path} scrolls sideways at {width} px: {scroll} > {client}"
            for table in page.locator("table").all():  # every column visible, none cut off or in a scroller
                assert table.evaluate("t => t.getBoundingClientRect().right") <= client, f"{path} at {width} px"
        page.goto(f"{proc.http}/runs/{runs['long_ids']['run_id']}")
        assert page.locator(f'#executors tr[data-executor="{LONG_UNIT}"] .delta').is_visible()
        if width == 390:
            page.goto(f"{proc.http}/runs/{runs['fail_under_report']['run_id']}")
            _screenshot(page, "run-page-phone.png", tmp_path)
    finally:
        context.close()


def test_an_over_report_is_agree_and_shown_for_what_it_is(site, page):
    """The writer's ledger says 600 tokens, its chat call 450: Agree by the verdict table (an
    over-report is flagged only with scoring.flag_over_reporting), and the units table says so."""
    proc, runs = site
    run = runs["over"]
    assert run["status"] == "PASS" and [e["verdict"] for e in run["executors"]] == ["Agree"]
    page.goto(f"{proc.http}/runs/{run['run_id']}")
    row = page.locator('#executors tr[data-executor="writer"]')
    assert row.get_attribute("class") == "over-reported"
    assert " ".join(row.locator('td[data-label="verdict"]').inner_text().split()) == "Agree (over-reported +33%)"
    assert " ".join(row.locator(".delta").inner_text().split()) == "+150 over"
    assert page.locator("[data-diverged]").count() == 0  # nothing diverged: no card says it did
    other = runs["pass"]
    page.goto(f"{proc.http}/runs/{other['run_id']}")
    assert page.locator("#executors tr.over-reported, .over-report").count() == 0


def test_timestamps_say_their_time_zone(site, page):
    proc, runs = site
    run = runs["fail_under_report"]
    page.goto(f"{proc.http}/runs")
    listed = page.locator(f'tr[data-run-id="{run["run_id"]}"] td').first.inner_text()
    page.goto(f"{proc.http}/runs/{run['run_id']}")
    shown = page.locator('dl.facts dt:text-is("updated") + dd').inner_text()
    assert listed == shown == _utc(proc, run)


def test_pending_page_explains_the_path2_gap_once_and_names_missing_finish_reasons(site, page):
    proc, runs = site
    page.goto(f"{proc.http}/runs/{runs['path2_pending']['run_id']}")
    text = page.locator("main").inner_text()
    assert text.count("Path-2") == 1
    assert "null" not in text
    assert page.locator('#executors tr[data-executor="writer"] .finish').inner_text() == "stop / none reported"


def test_a_suppressed_framework_finish_reason_is_called_out(site, page):
    proc, runs = site
    page.goto(f"{proc.http}/runs/{runs['finish_mismatch']['run_id']}")
    assert "null" not in page.locator("main").inner_text()
    for where in ('#executors tr[data-executor="reviewer"] .finish', '[data-diverged="reviewer"] .finish',
                  "table.finishes .diverged"):
        called_out = page.locator(where).locator(".suppressed")
        assert called_out.inner_text() == "none (suppressed)", where
        assert called_out.evaluate("e => getComputedStyle(e).color") == "rgb(207, 34, 46)", where  # --fail
    assert "content_filter" in page.locator('[data-diverged="reviewer"] .finish').inner_text()


def test_the_finish_that_diverged_is_named_with_its_invocation_not_the_last_one(site, page):
    """The unit's last pass agreed (stop / stop): the page said stop / stop beside FinishMismatch."""
    proc, runs = site
    page.goto(f"{proc.http}/runs/{runs['second_pass']['run_id']}")
    assert page.locator('[data-diverged="reviewer"] .finish').inner_text() == (
        "In invocation 2 of 3, the framework's finish reason is none (suppressed); "
        "the chat boundary's is content_filter.")
    assert page.locator('#executors tr[data-executor="reviewer"] .finish').inner_text() == (
        "none (suppressed) / content_filter differs")


def test_a_unit_without_a_ledger_shows_no_framework_numbers_not_a_suppressed_reason(site, page):
    """Nothing of the framework's was recorded: "none (suppressed)" blamed a ledger that is not there."""
    proc, runs = site
    page.goto(f"{proc.http}/runs/{runs['derived']['run_id']}")
    cells = page.locator('#executors tr[data-executor="writer"] td')
    assert cells.nth(3).inner_text() == "–" and cells.nth(4).inner_text() == "600"
    assert page.locator('#executors tr[data-executor="writer"] .finish').inner_text() == "– / stop"


def test_runs_list_shows_units_verdicts_and_reasons_and_each_id_once(site, page):
    proc, runs = site
    page.goto(f"{proc.http}/runs")
    unit_list = {name: page.locator(f'tr[data-run-id="{run["run_id"]}"] .units').inner_text()
                 for name, run in runs.items()}
    assert unit_list["fail_under_report"] == "researcher Agree · writer TokenMismatch"
    assert unit_list["path2_pending"] == "researcher NoTruth (response_missing) · writer NoTruth (response_missing)"
    assert unit_list["partial_warn"] == "researcher Agree · writer NoTruth (no_chat_trace)"
    assert "trace id" not in [h.inner_text() for h in page.locator("#runs th").all()]
    for run in runs.values():  # a run id starts with its trace id, else the trace id is shown beside it, once
        row = page.locator(f'tr[data-run-id="{run["run_id"]}"]')
        assert row.inner_text().count(run["trace_id"][:16]) == 1
        assert row.locator("a.run").inner_text() == run["run_id"]
    bench = runs["bench"]
    assert not bench["run_id"].startswith(bench["trace_id"])
    assert bench["trace_id"] in page.locator(f'tr[data-run-id="{bench["run_id"]}"]').inner_text()


def test_span_ids_link_to_the_trace_ui(site, page):
    proc, runs = site
    run = runs["long_ids"]
    page.goto(f"{proc.http}/runs/{run['run_id']}")
    _assert_span_ids_link(page, run, JAEGER)


def test_span_ids_link_to_the_span_when_the_template_names_it(site, page, tmp_path):
    proc, runs = site
    run = runs["fail_under_report"]
    spans = CollectorProcess(tmp_path, {"ui": {"trace_url": JAEGER_SPAN}}, store_url=proc.store_url)
    try:
        page.goto(f"{spans.http}/runs/{run['run_id']}")
        _assert_span_ids_link(page, run, JAEGER_SPAN)
        assert page.locator("#trace-id a").get_attribute("href") == JAEGER_SPAN.format(
            trace_id=run["trace_id"], span_id=run["root_span_id"])
    finally:
        spans.stop()


def test_run_page_states_start_and_links_the_run_document(site, sent, page):
    """An operator opening a run: when it started and how long it took (from the spans sent), when it
    was first reconciled and its JSON, behind the page's auth."""
    proc, runs = site
    run = runs["fail_under_report"]
    page.goto(f"{proc.http}/runs/{run['run_id']}")
    stored = proc.store().get_run(run["run_id"])
    started, duration = sent_times(sent[0], run["trace_id"])
    assert page.locator("#started").inner_text() == f"{started:%Y-%m-%d %H:%M:%S}.{started.microsecond // 1000:03d} UTC"
    assert shown_seconds(page.locator("#duration").inner_text()) == pytest.approx(duration, rel=5e-3)  # 3 digits
    first = datetime.fromtimestamp(stored["created_at"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert page.locator('dl.facts dt:text-is("first verdict") + dd').inner_text() == first
    assert stored["service_name"] and page.locator("#service").inner_text() == stored["service_name"]
    link = page.locator("a#json")
    assert link.get_attribute("href") == f"/runs/{run['run_id']}.json"
    status, body, headers = _get(f"{proc.http}{link.get_attribute('href')}")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body) == stored  # the stored document, as `runs show --json` prints it
    status, body, _ = _get(f"{proc.http}/runs/{run['run_id'][:12]}.json")  # a unique prefix, as the page takes
    assert status == 200 and json.loads(body)["run_id"] == run["run_id"]
    status, body, headers = _get(f"{proc.http}/runs/0000dead.json")
    assert status == 404 and headers["Content-Type"].startswith("application/json")
    assert "no run" in json.loads(body)["error"] and "runs.db" not in body


def test_run_json_needs_the_token_when_auth_is_on(tmp_path):
    token = "json-token-value"
    proc = CollectorProcess(tmp_path, {"receivers": {"auth": {"bearer_token_env": "AGENTEVAL_TOKEN"}}},
                            env={"AGENTEVAL_TOKEN": token})
    try:
        doc = json.loads((Path(__file__).parent.parent / "examples/pass_all_agree.json").read_text())
        store = proc.store()
        try:
            store.save_many([StoredRun("run-behind-auth", "file:x", reconcile(workflow_trace_run(doc, "x")))])
        finally:
            store.close()
        url = f"{proc.http}/runs/run-behind-auth.json"
        assert _get(url)[0] == 401
        status, body, _ = _get(url, {"Authorization": f"Bearer {token}"})
        assert status == 200 and json.loads(body)["run_id"] == "run-behind-auth"
    finally:
        proc.stop()


def test_a_document_of_an_earlier_version_without_per_call_details_says_so_and_links_each_chat_span(site, page):
    proc, runs = site
    run = runs["fail_under_report"]
    older = json.loads(json.dumps(run))  # as the previous version stored it: no per-call evidence
    for unit in older["executors"]:
        for key in ("chat_calls", "chat_calls_more", "ledger", "ledger_more"):
            del unit["evidence"][key]
    with sqlite3.connect(proc.store_path) as db:
        db.execute("UPDATE runs SET body = ? WHERE run_id = ?", (pack(json.dumps(older).encode()), run["run_id"]))
    try:
        page.goto(f"{proc.http}/runs/{run['run_id']}")
        writer = page.locator('details[data-unit="writer"]')
        assert writer.locator("table.chat-calls").count() == 0
        assert "not in this run's document" in writer.locator(".no-calls").inner_text()
        counts = writer.locator("table.unit-counts").inner_text()
        assert "ledger entries\t1" in counts and "chat calls with a response\t2" in counts
        _assert_span_ids_link(page, run, JAEGER)
    finally:
        with sqlite3.connect(proc.store_path) as db:
            db.execute("UPDATE runs SET body = ? WHERE run_id = ?", (pack(json.dumps(run).encode()), run["run_id"]))


def test_per_chat_call_table_beside_the_ledger_entries(site, page):
    """Debugging a divergence from the page alone: per call the span, model, provider, tokens,
    finish and error; the ledger entry the framework reported; the input/output split; the service."""
    proc, runs = site
    run = runs["per_call"]
    page.goto(f"{proc.http}/runs/{run['run_id']}")
    assert page.locator("#service").inner_text() == run["service_name"] == "maf-app"
    writer = page.locator('details[data-unit="writer"]')
    assert writer.get_attribute("open") is not None  # it diverged: open
    heads = [h.inner_text() for h in writer.locator("table.chat-calls th").all()]
    assert heads == ["span id", "model", "provider", "input", "output", "total", "finish", "error"]
    ev = next(e for e in run["executors"] if e["executor_id"] == "writer")["evidence"]
    rows = writer.locator("table.chat-calls tbody tr")
    assert rows.count() == len(ev["chat_span_ids"]) == 3
    cells = [[c.inner_text() for c in rows.nth(i).locator("td").all()] for i in range(3)]
    # total: input + output, as compared (MAF's chat spans report no total of their own)
    assert cells[0] == [ev["chat_span_ids"][0], "fake-model", "openai", "400", "80", "480", "tool_calls", "–"]
    assert cells[2] == [ev["chat_span_ids"][2], "fake-model", "openai", "320", "160", "480", "stop", "–"]
    assert rows.nth(1).get_attribute("class") == "failed"
    assert cells[1][3:6] == ["–", "–", "–"] and "failed: RateLimitError 429 Too Many Requests" in cells[1][7]
    assert rows.nth(0).locator("td a").first.get_attribute("href") == JAEGER.format(trace_id=run["trace_id"])
    ledger = writer.locator("table.ledger tbody tr")
    assert ledger.count() == len(ev["ledger_span_ids"]) == 1
    assert [c.inner_text() for c in ledger.nth(0).locator("td").all()] == [ev["ledger_span_ids"][0], "300", "240",
                                                                            "540", "stop"]
    split = writer.locator("table.unit-counts").inner_text()
    assert "input tokens: framework / truth\t300 / 720" in split
    assert "output tokens: framework / truth\t240 / 240" in split
    assert "chat calls that failed\t1" in split
    _assert_span_ids_link(page, run, JAEGER)


def test_a_trace_id_of_a_trace_holding_several_runs_lists_them(tmp_path):
    """A caller span around two workflow runs makes one trace of two runs: its trace id, pasted from a
    trace UI, leads to both (the page lists them, linked); the JSON API names them in its 404."""
    from test_runs import Recorder

    proc = CollectorProcess(tmp_path)
    try:
        rec = Recorder()
        runs = []
        with rec.tracer.start_as_current_span("session") as session:
            for name, reported in (("triage", (400, 40)), ("summary", (100, 10))):
                with rec.tracer.start_as_current_span("workflow.run", attributes={"workflow.name": name}) as run:
                    rec.agent("worker", "worker", [(400, 40)], reported)
                runs.append(f"{session.get_span_context().trace_id:032x}-{run.get_span_context().span_id:016x}")
        export_spans(proc, rec.take())
        trace_id = runs[0].split("-")[0]
        deadline = time.monotonic() + 15
        while len(proc.store().runs_matching(trace_id, 3)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body, _ = _get(f"{proc.http}/runs/{trace_id}")  # follows the redirect
        assert status == 200
        assert [proc.store().get_run(r)["status"] for r in runs] == ["PASS", "FAIL"]
        for run_id in runs:
            assert f'href="/runs/{run_id}"' in body
        assert body.count('<tr data-run-id=') == 2 and 'data-status="FAIL"' in body
        status, body, _ = _get(f"{proc.http}/runs/{trace_id}.json")
        assert status == 404 and all(r in json.loads(body)["error"] for r in runs)
    finally:
        proc.stop()


def _summary(html: str) -> str:
    """The run page's summary paragraph as text (tags dropped, spaces joined)."""
    summary = re.search(r'<p id="summary">(.*?)</p>', html, re.S)[1]
    return " ".join(re.sub(r"<[^>]+>", "", summary).split())


def test_a_pending_run_of_a_complete_trace_says_it_is_final_and_what_would_fix_it(site):
    """"No verdict yet" read as "wait": the trace was complete, nothing was ever going to be checked."""
    proc, runs = site
    status, html, _ = _get(f"{proc.http}/runs/{runs['path2_pending']['run_id']}")
    assert status == 200 and not runs["path2_pending"]["incomplete"]
    summary = _summary(html)
    assert "No verdict yet" not in html and "yet" not in summary
    assert summary.startswith("Final: nothing was checked.")
    assert "none of its 2 agent unit(s) could be checked honestly (response_missing)" in summary
    assert "waiting will not change it" in summary and "This is not a pass" in summary
    assert 'href="#why-response_missing"' in html and 'id="why-response_missing"' in html  # to its fix
    status, html, _ = _get(f"{proc.http}/runs/{runs['derived']['run_id']}")
    summary = _summary(html)
    assert summary.startswith("Final: nothing was checked.") and "(ledger_derived)" in summary


def _lines(locator) -> int:
    """How many lines an inline element takes on the screen."""
    return locator.evaluate("e => new Set([...e.getClientRects()].map(r => Math.round(r.top))).size")


def test_run_ids_and_reasons_stay_on_one_line_on_a_desktop_screen(site, page):
    """At 1366 px a live run id (49 characters) wrapped over two lines on /runs, and response_missing
    broke mid-word in the run page's verdict column."""
    proc, runs = site
    page.goto(f"{proc.http}/runs")
    for run in runs.values():
        assert _lines(page.locator(f'tr[data-run-id="{run["run_id"]}"] a.run')) == 1, run["run_id"]
    page.goto(f"{proc.http}/runs/{runs['path2_pending']['run_id']}")
    reasons = page.locator("#executors td code")
    assert reasons.count() == 2 and all(_lines(code) == 1 for code in reasons.all())
    assert _lines(page.locator("dl.facts .id").first) == 1  # the run id beside "run id"


def test_the_runs_page_counts_runs_by_status_over_a_chosen_range_and_shows_each_runs_service(tmp_path):
    """A run written two hours ago is out of the last hour's list and counts, in "all"'s; a run's
    service.name stands beside its subject where they differ."""
    proc = CollectorProcess(tmp_path)
    try:
        fresh_spans, (pass_id, fail_id) = record([SCENARIOS["pass"][0], SCENARIOS["fail_under_report"][0]],
                                                 service="billing-svc")
        old_spans, (old_id,) = record([SCENARIOS["finish_mismatch"][0]], service="billing-svc")
        export_spans(proc, fresh_spans + old_spans)
        runs = {name: proc.run(trace) for name, trace in (("pass", pass_id), ("fail", fail_id), ("old", old_id))}
        with sqlite3.connect(proc.store_path) as db:
            db.execute("UPDATE runs SET updated_at = updated_at - 7200 WHERE run_id = ?", (runs["old"]["run_id"],))

        status, recent, _ = _get(f"{proc.http}/runs?range=1h")
        assert status == 200
        counts = re.search(r'<p id="counts">(.*?)</p>', recent, re.S).group(1)
        assert re.sub(r"<[^>]+>|\s+", " ", counts).split() == [
            "Runs", "written", "in", "the", "last", "1h:", "PASS", "1", "·", "WARN", "0", "·", "FAIL", "1", "·",
            "PENDING", "0"]
        assert runs["old"]["run_id"] not in recent
        assert runs["pass"]["run_id"] in recent and runs["fail"]["run_id"] in recent
        assert recent.count('<span class="muted service">billing-svc</span>') == 2  # subject: the workflow's name

        _, everything, _ = _get(f"{proc.http}/runs?range=all")
        assert runs["old"]["run_id"] in everything
        assert re.sub(r"<[^>]+>|\s+", " ", re.search(r'<p id="counts">(.*?)</p>', everything, re.S).group(1)).split()[
            2:] == ["PASS", "1", "·", "WARN", "1", "·", "FAIL", "1", "·", "PENDING", "0"]
        # a count links to that status over the same range
        assert 'href="/runs?status=FAIL&amp;subject=&amp;range=1h&amp;limit=50"' in recent
        assert _get(f"{proc.http}/runs?range=3w")[0] == 400
    finally:
        proc.stop()
