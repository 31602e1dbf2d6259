"""The run page (/runs, /runs/{id}) in real headless Chromium, plus its HTTP edges.

Set AGENTEVAL_SCREENSHOTS=docs to refresh the committed screenshots (`make screenshots`).
CI sets AGENTEVAL_REQUIRE_BROWSER=1, so a missing Chromium fails there instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import CollectorProcess, export_spans
from mafshape import SCENARIOS, Invocation, Scenario, ok, record

JAEGER = "http://localhost:16686/trace/{trace_id}"
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


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    proc = CollectorProcess(tmp_path_factory.mktemp("page"), {"receivers": {"http": {"trace_link": JAEGER}}})
    names = ["pass", "fail_under_report", "path2_pending", "partial_warn", "finish_mismatch"]
    spans, ids = record([SCENARIOS[n][0] for n in names])
    hostile = Scenario({"w<i>": [Invocation([ok(10, 5)])]}, name="<script>alert(1)</script>")
    more, (hostile_id,) = record([hostile])
    export_spans(proc, spans + more)
    runs = {n: proc.run(i) for n, i in zip(names, ids)}
    runs["hostile"] = proc.run(hostile_id)
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
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    yield context.new_page()
    context.close()


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
        assert row.locator(".badge").inner_text() == run["status"]
    page.select_option("select[name=status]", "PENDING")
    page.click("button[type=submit]")
    page.wait_for_url("**status=PENDING**")
    assert [r.get_attribute("data-run-id") for r in page.locator("#runs tbody tr").all()] == [runs["path2_pending"]["run_id"]]


def test_fail_run_page_explains_the_token_divergence(site, page, tmp_path):
    proc, runs = site
    run = runs["fail_under_report"]
    page.goto(f"{proc.http}/runs")
    page.locator(f'tr[data-run-id="{run["run_id"]}"] a').click()
    page.wait_for_url(f"**/runs/{run['run_id']}")
    assert page.locator("#status").inner_text() == "FAIL"
    writer = page.locator('#executors tr[data-executor="writer"]')
    cells = [c.inner_text() for c in writer.locator("td").all()]
    assert cells[1] == "TokenMismatch" and cells[3] == "540" and cells[4] == "960"
    assert cells[5].startswith("-420") and "under" in cells[5]
    assert page.locator('#executors tr[data-executor="researcher"]').get_attribute("data-verdict") == "Agree"
    diverged = page.locator('[data-diverged="writer"]').inner_text()
    assert "reported 540 tokens" in diverged and "summed 960 over 2 chat call(s)" in diverged and "43.8% under" in diverged
    assert page.locator("#trace-id a").get_attribute("href") == JAEGER.format(trace_id=run["trace_id"])
    assert "SECRET-PROMPT" not in page.content() and "SECRET-ANSWER" not in page.content()
    _screenshot(page, "run-page-fail.png", tmp_path)


def test_pending_run_page_says_why_each_executor_has_no_truth(site, page, tmp_path):
    proc, runs = site
    run = runs["path2_pending"]
    page.goto(f"{proc.http}/runs/{run['run_id'][:10]}")  # a unique prefix is enough
    assert page.locator("#status").inner_text() == "PENDING"
    assert "none of the 2 agent unit(s) could be checked" in page.locator("#summary").inner_text()
    assert "This is not a pass" in page.locator("#summary").inner_text()
    for executor in ("researcher", "writer"):
        card = page.locator(f'[data-no-truth="{executor}"]')
        assert "response_missing" in card.inner_text()
        assert "Path-2 gap" in card.locator(".explanation").inner_text()
        assert "InProcessExecution" in card.locator(".fix").inner_text()
    assert page.locator('#executors tr[data-executor="writer"] td').nth(9).inner_text() == "0 / 0 / 2"
    _screenshot(page, "run-page-pending.png", tmp_path)


def test_warn_page_distinguishes_no_chat_trace_from_a_finish_mismatch(site, page):
    proc, runs = site
    page.goto(f"{proc.http}/runs/{runs['partial_warn']['run_id']}")
    assert "no_chat_trace" in page.locator('[data-no-truth="writer"]').inner_text()
    assert "ChatTelemetryLayer" in page.locator('[data-no-truth="writer"] .fix').inner_text()
    page.goto(f"{proc.http}/runs/{runs['finish_mismatch']['run_id']}")
    finish = page.locator('[data-diverged="reviewer"] .finish').inner_text()
    assert "null (suppressed)" in finish and "content_filter" in finish


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
