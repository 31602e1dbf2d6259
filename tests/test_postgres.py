"""Two collector replicas on one PostgreSQL history: every read path shows every run, a watcher on
one replica sees the other's verdicts, and a database restart mid-stream loses nothing."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import psycopg
import pytest

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.store import StoreError, open_store
from collector.store.schema import SCHEMA_VERSION

from conftest import AGENTEVAL, PG_PASSWORD_USER, CollectorProcess, export_spans, post
from mafshape import SCENARIOS, export_request, record, run_id
from test_store_outage import get
from test_stream import Follower, _wait_watchers


@pytest.fixture
def replicas(postgres, tmp_path):
    url = postgres.database()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = CollectorProcess(tmp_path / "a", store_url=url)
    b = CollectorProcess(tmp_path / "b", store_url=url)
    yield url, a, b
    a.stop(), b.stop()


def test_two_replicas_share_one_history_stream_and_run_page(replicas):
    url, a, b = replicas
    stub_a = FidelityServiceStub(grpc.insecure_channel(a.grpc))
    watcher_on_a = Follower(stub_a, pb.WatchRequest())
    _wait_watchers(a, 1)
    spans_a, (trace_a,) = record([SCENARIOS["pass"][0]])
    spans_b, (trace_b,) = record([SCENARIOS["path2_pending"][0]])
    on_a, on_b = run_id(trace_a), run_id(trace_b)
    export_spans(a, spans_a)
    export_spans(b, spans_b)
    assert a.run(on_b)["status"] == "PENDING" and b.run(on_a)["status"] == "PASS"
    # The watcher attached to replica A sees the run replica B finalized (LISTEN/NOTIFY), exactly once.
    got = watcher_on_a.wait(2)
    assert sorted(m.run_id for m in got) == sorted([on_a, on_b])
    assert {m.run_id: m.finalized_by for m in got}[on_b] == b.run(on_b)["finalized_by"]
    watcher_on_a.call.cancel()
    # `agenteval runs list`, GetRun on either replica, and either run page show both.
    listed = json.loads(subprocess.run([AGENTEVAL, "runs", "list", "--json", "--store", url],
                                       capture_output=True, text=True, timeout=60, check=True).stdout)
    assert {r["run_id"] for r in listed} == {on_a, on_b}
    assert FidelityServiceStub(grpc.insecure_channel(b.grpc)).GetRun(pb.GetRunRequest(run_id=on_a)).run_id == on_a
    page = urllib.request.urlopen(f"{a.http}/runs/{on_b}", timeout=10).read().decode()
    assert "PENDING" in page and "response_missing" in page


def test_a_late_span_revision_supersedes_for_every_reader(replicas):
    _, a, b = replicas
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    late = next(s for s in spans if s.name.startswith("chat"))
    export_spans(a, [s for s in spans if s is not late])
    first = b.run(trace_id)
    assert first["revision"] == 1
    watcher_on_b = Follower(FidelityServiceStub(grpc.insecure_channel(b.grpc)), pb.WatchRequest())
    _wait_watchers(b, 1)
    export_spans(a, [late])
    assert b.run(trace_id, revision=2)["revision"] == 2
    deadline = time.monotonic() + 15
    while not any(m.revision == 2 for m in watcher_on_b.got) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Revision 1 may still be in flight to B's listener when the watcher attaches; revision 2 follows.
    assert [m.revision for m in watcher_on_b.got if m.run_id == run_id(trace_id)][-1] == 2
    watcher_on_b.call.cancel()


def test_database_restart_mid_stream_loses_no_verdict(postgres, tmp_path):
    url = postgres.database()
    proc = CollectorProcess(tmp_path, store_url=url)
    sent: list[str] = []
    stop_sending = threading.Event()

    def sender():
        while not stop_sending.is_set():
            spans, (trace_id,) = record([SCENARIOS["fail_under_report"][0]])
            export_spans(proc, spans)  # asserts SUCCESS: ingest never stops during the outage
            sent.append(trace_id)
            time.sleep(0.05)

    thread = threading.Thread(target=sender)
    try:
        thread.start()
        while len(sent) < 5:
            time.sleep(0.05)
        postgres.stop()
        try:
            outage_started = len(sent)
            deadline = time.monotonic() + 30
            queued = errors = 0
            while time.monotonic() < deadline and (len(sent) < outage_started + 10 or not queued or not errors):
                metrics = proc.metrics()
                queued = metrics.get(("agenteval_store_queued_runs", ()), 0)
                errors = sum(v for (name, _), v in metrics.items() if name == "agenteval_store_errors_total")
                time.sleep(0.1)
            assert queued > 0, "verdicts were not queued during the outage"
            assert errors > 0, "failed writes were not counted"
            assert len(sent) >= outage_started + 10, "ingest stalled during the outage"
        finally:
            postgres.start()
        time.sleep(0.5)
    finally:
        stop_sending.set()
        thread.join()
    for trace_id in sent:
        assert proc.run(trace_id, timeout=60)["status"] == "FAIL"
    assert len(proc.store().list_runs(limit=10_000)) == len(sent)
    assert proc.metrics()[("agenteval_store_queued_runs", ())] == 0
    assert proc.stop() == 0


def test_a_full_store_backlog_refuses_ingest_with_a_retryable_status(postgres, tmp_path):
    url = postgres.database()
    proc = CollectorProcess(tmp_path, {"store": {"max_queued_runs": 2}}, store_url=url)
    try:
        postgres.stop()
        try:
            for _ in range(2):
                spans, _ids = record([SCENARIOS["pass"][0]])
                assert post(proc.http, export_request(spans).SerializeToString())[0] == 200
            deadline = time.monotonic() + 15
            while proc.metrics().get(("agenteval_store_queued_runs", ()), 0) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            spans, _ids = record([SCENARIOS["pass"][0]])
            status, _, headers = post(proc.http, export_request(spans).SerializeToString())
            assert status == 503 and "Retry-After" in headers
            deadline = time.monotonic() + 30  # once a write has failed (each waits for a connection)
            while (ready := get(f"{proc.http}/readyz"))[1]["store"] != "failing":
                assert ready[0] == 200 and time.monotonic() < deadline, ready
                time.sleep(0.2)
            assert ready[0] == 503 and ready[1]["ready"] is False
            refused = proc.metrics()[("agenteval_spans_refused_total",
                                      (("reason", "store_backlog"), ("transport", "http")))]
            assert refused == len(spans)
        finally:
            postgres.start()
        deadline = time.monotonic() + 30
        while len(proc.store().list_runs()) < 2:
            assert time.monotonic() < deadline, "queued verdicts were not written after the restart"
            time.sleep(0.1)
        assert post(proc.http, export_request(spans).SerializeToString())[0] == 200
        assert get(f"{proc.http}/readyz") == (200, {"ready": True, "store": "open"})
    finally:
        proc.stop()


def test_password_comes_from_a_file_and_is_never_logged(postgres, tmp_path):
    dbname = postgres.database().rsplit("/", 1)[1]
    url = postgres.url(dbname, user=PG_PASSWORD_USER)
    secret = tmp_path / "pw"
    secret.write_text("right-horse-battery\n")
    proc = CollectorProcess(tmp_path, {"store": {"password_file": str(secret)}}, store_url=url)
    try:
        assert proc.listening["store"] == f"postgresql://{PG_PASSWORD_USER}@127.0.0.1:{postgres.port}/{dbname}"
    finally:
        proc.stop()
    assert "right-horse-battery" not in proc.stderr_path.read_text()
    secret.write_text("wrong-horse\n")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"store:\n  url: {url}\n  password_file: {secret}\nexporters:\n  prometheus:\n    enabled: false\n"
                   "receivers:\n  grpc:\n    endpoint: 127.0.0.1:0\n  http:\n    endpoint: 127.0.0.1:0\n")
    res = subprocess.run([AGENTEVAL, "collector", "serve", "--config", str(cfg)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "password authentication failed" in res.stderr
    assert "wrong-horse" not in res.stderr + res.stdout


def test_collector_refuses_to_start_on_a_newer_schema(postgres, tmp_path):
    url = postgres.database()
    open_store(url).close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO agenteval_schema VALUES (%s)", (SCHEMA_VERSION + 1,))
    res = subprocess.run([AGENTEVAL, "runs", "list", "--store", url], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "newer than this agenteval knows" in res.stderr


def test_a_database_outage_makes_reads_retryable_without_telling_clients_where_the_store_is(postgres, tmp_path):
    """GetRun, ListRuns and the run page during an outage: UNAVAILABLE / 503, retryable, and the
    database's address, user and name stay in the collector's log (they reached gRPC clients as
    UNKNOWN "Unexpected StoreError: postgresql://...")."""
    url = postgres.database()
    proc = CollectorProcess(tmp_path, store_url=url)
    stub = FidelityServiceStub(grpc.insecure_channel(proc.grpc))
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    try:
        export_spans(proc, spans)
        assert proc.run(trace_id)["status"] == "PASS"
        postgres.stop()
        try:
            hidden = (str(postgres.port), url.rsplit("/", 1)[1])
            for call in (lambda: stub.GetRun(pb.GetRunRequest(run_id=run_id(trace_id))),
                         lambda: stub.ListRuns(pb.ListRunsRequest())):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE
                assert "retry later" in err.value.details() and not any(h in err.value.details() for h in hidden)
            with pytest.raises(urllib.error.HTTPError) as page:
                urllib.request.urlopen(f"{proc.http}/runs/{run_id(trace_id)}", timeout=15)
            body = page.value.read().decode()
            assert page.value.code == 503 and "retry later" in body and not any(h in body for h in hidden)
            assert int(page.value.headers["Retry-After"]) > 0  # a browser or a script knows when
        finally:
            postgres.start()
        failed = [e for e in proc.log_events() if e.get("event") == "store_read_failed"]
        assert {e["transport"] for e in failed} == {"grpc", "http"} and str(postgres.port) in failed[0]["error"]
        deadline = time.monotonic() + 30
        while True:  # the pool reconnects
            try:
                assert stub.GetRun(pb.GetRunRequest(run_id=run_id(trace_id))).status == pb.STATUS_PASS
                break
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.stop()


def test_a_read_of_a_locked_table_is_answered_retry_later_not_held(postgres, tmp_path):
    """Another session holds the runs table (a replica's migration, an operator's VACUUM FULL or
    ALTER TABLE): each read gives up after READ_WAIT with a retryable error instead of waiting as
    long as the lock is held: GetRun is UNAVAILABLE "retry later", and the replay check, which
    runs on the collector's event loop, cannot hold the collector up."""
    url = postgres.database()
    proc = CollectorProcess(tmp_path, store_url=url)
    stub = FidelityServiceStub(grpc.insecure_channel(proc.grpc))
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    store = open_store(url)
    try:
        export_spans(proc, spans)
        assert proc.run(trace_id)["status"] == "PASS"
        with psycopg.connect(url) as holder:
            holder.execute("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
            for read in (lambda: store.get_run(run_id(trace_id)), lambda: store.list_runs(),
                         lambda: store.revisions([run_id(trace_id)]), lambda: store.traces_with_runs([trace_id])):
                with pytest.raises(StoreError, match="lock timeout"):
                    _within(30, read)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetRun(pb.GetRunRequest(run_id=run_id(trace_id)), timeout=60)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE and "retry later" in err.value.details()
        assert store.get_run(run_id(trace_id))["status"] == "PASS"  # the lock gone, the same pool reads again
        assert stub.GetRun(pb.GetRunRequest(run_id=run_id(trace_id))).status == pb.STATUS_PASS
    finally:
        store.close()
        proc.stop()


def _within(seconds: float, call):
    """``call()``'s result or exception, failing the test if it has not returned after ``seconds``
    (a liveness bound: without the read timeout it waits as long as the lock is held)."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = call()
        except Exception as exc:  # any failure: handed back to the caller
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]
