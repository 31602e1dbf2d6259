"""The crash journal (docs/design.md §3 Durability): what a 200 means is that the spans are on disk."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime
from typing import Any

import orjson
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from collector.config import CollectorConfig
from collector.core.facts import FINISH, INPUT, TOTAL, SpanRecord
from collector.formats import decode
from collector.live.journal import Journal, encode
from collector.live.journal import decode as journal_decode

from conftest import AGENTEVAL, CollectorProcess, export_spans, free_port, post
from mafshape import SCENARIOS, export_request, record, run_id, sent_times
from test_crash import NAMES as CRASH_SCENARIOS
from test_crash import RETRYABLE_HTTP, problems, runs_by_trace
from test_crash import Trace as CrashTrace

LONG = {"assembly": {"quiet_period": 60, "max_trace_wait": 600}}


def segments(proc: CollectorProcess) -> list:
    return sorted((proc.store_path.parent / "runs.db.journal").glob("*.jsonl"))


def test_acknowledged_spans_survive_kill_9_and_are_reconciled_after_restart(tmp_path):
    spans, (trace_id,) = record([SCENARIOS["fail_under_report"][0]])
    first = CollectorProcess(tmp_path, overrides=LONG)
    export_spans(first, spans)  # acknowledged; the trace is still waiting for its quiet period
    first.stop(signal.SIGKILL)
    second = CollectorProcess(tmp_path)  # default quiet period: replayed, then complete
    try:
        run = second.run(trace_id)
        assert run["status"] == "FAIL" and run["run_id"] == run_id(trace_id)
        assert {e["executor_id"]: e["verdict"] for e in run["executors"]} == SCENARIOS["fail_under_report"][2]
        assert any(e.get("event") == "journal_replayed" for e in second.log_events())
    finally:
        assert second.stop() == 0


def test_runs_stored_before_a_kill_9_are_not_published_again_by_the_replay(tmp_path):
    """A journal segment outlives its stored traces while another trace in it is open, so after a
    kill -9 the replay finalizes them again: the store keeps one copy, and the run is not counted,
    logged or streamed a second time either. The open trace's run is published as usual."""
    done, (stored_id,) = record([SCENARIOS["pass"][0]])
    waiting, (open_id,) = record([SCENARIOS["fail_under_report"][0]])
    rootless = [s for s in waiting if s.parent is not None]  # no root: it waits for max_trace_wait
    first = CollectorProcess(tmp_path, overrides={"assembly": {"max_trace_wait": 600}})
    export_spans(first, done + rootless)  # one request, one journal segment
    assert first.run(stored_id)["status"] == "PASS"
    first.stop(signal.SIGKILL)
    second = CollectorProcess(tmp_path, overrides={"assembly": {"max_trace_wait": 2.0}})
    try:
        assert second.run(open_id)["status"] == "FAIL"
        time.sleep(1.0)  # both traces replayed and finalized by now
        assert [e["trace_id"] for e in second.log_events() if e.get("event") == "run_verdict"] == [open_id]
        counted = {labels: v for (name, labels), v in second.metrics().items() if name == "agenteval_runs_total" and v}
        # rootless: its service.name; no MAF instrumentation announced a release (no maf_release label)
        assert counted == {(("status", "FAIL"), ("subject", "maf-app")): 1}
        assert second.run(stored_id)["revision"] == 1
    finally:
        assert second.stop() == 0


def test_the_journal_holds_span_records_never_prompt_text(tmp_path):
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])  # its chat spans carry SECRET-PROMPT / SECRET-ANSWER
    proc = CollectorProcess(tmp_path, overrides=LONG)
    try:
        export_spans(proc, spans)
        (segment,) = segments(proc)
        text = segment.read_text()
        rows = orjson.loads(text)
        assert trace_id in text and any(row[5][INPUT:TOTAL + 1] == [420, 180, None] for row in rows)  # the researcher's
        assert "SECRET" not in text and "gen_ai" not in text
    finally:
        proc.stop(signal.SIGKILL)


def test_segments_are_deleted_once_their_traces_are_stored(tmp_path):
    proc = CollectorProcess(tmp_path, overrides={"journal": {"segment_bytes": 4096}})
    try:
        ids = []
        for name in ("pass", "loop", "fail_under_report", "path2_pending"):
            spans, (trace_id,) = record([SCENARIOS[name][0]])
            export_spans(proc, spans)
            ids.append(trace_id)
        for trace_id in ids:
            proc.run(trace_id)
        deadline = time.monotonic() + 10
        while len(segments(proc)) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(segments(proc)) <= 1  # only the segment being written remains
    finally:
        assert proc.stop() == 0
    assert segments(proc) == []  # a clean shutdown leaves nothing to replay


def test_one_journal_per_collector_and_it_can_be_turned_off(tmp_path):
    first = CollectorProcess(tmp_path)
    assert first.listening["journal"] == str(first.store_path.parent / "runs.db.journal")  # logged at start
    try:
        config = yaml.safe_load(first.config_path.read_text())
        config.setdefault("exporters", {})["otlp"] = {"endpoint": f"http://127.0.0.1:{free_port()}",
                                                      "protocol": "http/protobuf"}
        second_config = tmp_path / "second.yaml"
        second_config.write_text(yaml.safe_dump(config))
        second = subprocess.run([AGENTEVAL, "collector", "serve", "--config", str(second_config)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "journal in use by another collector" in second.stderr
        assert "Traceback" not in second.stderr, second.stderr  # metrics pushed on the way out found no pipeline
    finally:
        first.stop()
    off = CollectorProcess(tmp_path / "off", overrides={"journal": {"enabled": False}})
    try:
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        assert post(off.http, export_request(spans).SerializeToString())[0] == 200
        assert off.run(trace_id)["status"] == "PASS"
        assert not (off.store_path.parent / "runs.db.journal").exists() and off.listening["journal"] is None
    finally:
        off.stop()


def test_the_segment_being_written_frees_its_room_once_its_traces_are_done(tmp_path):
    """``max_bytes`` bounds the spans still needed: the current segment counts while a trace in it
    is open, not after; it stays the segment written (a late span's trace keeps its earlier records
    beside it, for a replay)."""
    matcher = CollectorConfig().matcher()
    first, second = (decode.decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), matcher).spans
                     for _ in range(2))

    async def scenario() -> None:
        journal = Journal(tmp_path, 1 << 20, 1000)
        journal.start()
        try:
            await journal.append(first)
            assert journal.full() and journal.size > 1000  # one request over max_bytes, its trace open
            (old,) = tmp_path.glob("*.jsonl")
            journal.release([(first[0].trace_id, journal.mark())])
            assert not journal.full() and old.exists()
            await journal.append(second)
            assert old.exists() and journal.full()  # the second trace is open in it
            assert [p.stat().st_size for p in tmp_path.glob("*.jsonl")] == [journal.size]
        finally:
            journal.close()

    asyncio.run(scenario())


def test_a_torn_last_record_is_skipped_and_the_rest_replayed(tmp_path):
    spans, (trace_id,) = record([SCENARIOS["loop"][0]])
    first = CollectorProcess(tmp_path, overrides=LONG)
    export_spans(first, spans)
    first.stop(signal.SIGKILL)
    (segment,) = segments(first)
    with segment.open("ab") as fh:
        fh.write(b'[["torn')  # a crash in the middle of a write
    second = CollectorProcess(tmp_path)
    try:
        assert second.run(trace_id)["status"] == "PASS"
    finally:
        second.stop()


def typed(value: Any) -> Any:
    """``value`` with its types spelled out (True is not 1, 1.0 is not 1)."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return type(value).__name__, value


def fields(spans: list[SpanRecord]) -> list[tuple]:
    return [tuple(typed(getattr(s, name)) for name in SpanRecord.__slots__) for s in spans]


def test_a_native_journal_line_is_written_as_is_and_replayed_as_its_spans(tmp_path):
    if not decode.NATIVE:
        if os.environ.get("AGENTEVAL_REQUIRE_NATIVE") == "1":
            pytest.fail("agenteval_native is not installed")
        pytest.skip("agenteval_native is not installed: `make install` builds it (needs Rust)")
    values = [AnyValue(string_value='quote " backslash \\ newline \n nul \x00 é 😀'), AnyValue(int_value=-(2**63)),
              AnyValue(double_value=1e16), AnyValue(double_value=-0.0), AnyValue(bool_value=True),
              AnyValue(bytes_value=b"\xff"), AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1)])),
              AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="", value=AnyValue(double_value=2.0))]))]
    matcher = CollectorConfig().matcher()
    keys = sorted(matcher.wanted_keys)
    spans = [Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="chat \t", start_time_unix_nano=2**64 - 1,
                  attributes=[KeyValue(key=k, value=v) for k, v in zip(keys, values, strict=False)],
                  status=Status(code=Status.STATUS_CODE_ERROR, message="boom")),
             Span(trace_id=b"\x01" * 16, span_id=b"\x03" * 8, parent_span_id=b"\x02" * 8, name="invoke_agent")]
    payload = ExportTraceServiceRequest(resource_spans=[
        ResourceSpans(resource=Resource(attributes=[KeyValue(key="service.name", value=AnyValue(string_value="svc"))]),
                      scope_spans=[ScopeSpans(spans=spans[:1])]),
        ResourceSpans(scope_spans=[ScopeSpans(spans=spans[1:])]),  # no resource subject
    ]).SerializeToString()
    decoded = decode._native_decode(payload, matcher)
    assert decoded is not None and decoded.journal_line is not None

    async def append() -> None:
        journal = Journal(tmp_path, 1 << 20, 1 << 30)
        journal.start()
        try:
            await journal.append(decoded.spans, decoded.journal_line)
        finally:
            journal.close()

    asyncio.run(append())
    (segment,) = tmp_path.glob("*.jsonl")
    assert segment.read_bytes() == decoded.journal_line  # the line as given, not encoded again
    journal = Journal(tmp_path, 1 << 20, 1 << 30)  # a restart: the segment is replayed
    journal.start()
    try:
        (replayed,) = journal.replay(matcher)
    finally:
        journal.close()
    assert fields(replayed) == fields(decoded.spans) == fields(journal_decode(encode(decoded.spans), matcher))


def test_a_journal_of_the_previous_format_replays_with_its_spans_facts(tmp_path):
    """An upgrade over a journal left by a crash: rows that hold the wanted attributes (before span
    facts) replay as the spans the new decoder gives for the same request."""
    matcher = CollectorConfig().matcher()
    spans, _ = record([SCENARIOS["fail_under_report"][0]])
    request = export_request(spans)
    decoded = decode.decode_request(request, matcher)
    attrs = [{kv.key: decode.any_value(kv.value) for kv in span.attributes if kv.key in matcher.wanted_keys}
             for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
    rows = [[s.trace_id.hex(), s.span_id.hex(), s.parent_id.hex(), s.name, s.start_ns, a, s.resource_subject,
             s.status_error, s.sdk_language] for s, a in zip(decoded.spans, attrs, strict=True)]
    (tmp_path / f"{1:012d}.jsonl").write_bytes(orjson.dumps(rows) + b"\n" + b'[["torn')
    journal = Journal(tmp_path, 1 << 20, 1 << 30)
    journal.start()
    try:
        (replayed,) = journal.replay(matcher)
    finally:
        journal.close()
    assert fields(replayed) == fields([replace(s, end_ns=None) for s in decoded.spans])  # no end times then
    assert {s.facts[FINISH] for s in replayed} >= {"stop"} and any(s.facts[INPUT] for s in replayed)


def test_a_journal_line_without_end_times_replays_with_the_ends_unknown(tmp_path):
    """An upgrade over a journal an earlier version left at a crash, whose rows (nine values) hold no
    end time: its spans replay whole with their ends unknown, and the run they make says when it
    started and that how long it took is not known (null, never a duration made up)."""
    matcher = CollectorConfig().matcher()
    spans, (trace_id,) = record([SCENARIOS["fail_under_report"][0]])
    decoded = decode.decode_request(export_request(spans), matcher).spans
    assert all(s.end_ns for s in decoded)
    line = orjson.dumps([[s.trace_id.hex(), s.span_id.hex(), s.parent_id.hex(), s.name, s.start_ns, s.facts,
                          s.resource_subject, s.status_error, s.sdk_language] for s in decoded]) + b"\n"
    for directory in (tmp_path / "replayed", tmp_path / "served" / "runs.db.journal"):
        directory.mkdir(parents=True)
        (directory / f"{1:012d}.jsonl").write_bytes(line)
    journal = Journal(tmp_path / "replayed", 1 << 20, 1 << 30)
    journal.start()
    try:
        (replayed,) = journal.replay(matcher)
    finally:
        journal.close()
    assert fields(replayed) == fields([replace(s, end_ns=None) for s in decoded])
    proc = CollectorProcess(tmp_path / "served")  # replays the line on start
    try:
        run = proc.run(trace_id)
    finally:
        proc.stop()
    assert run["status"] == "FAIL" and run["duration_s"] is None
    assert datetime.fromisoformat(run["started_at"]) == sent_times(spans, trace_id)[0]


def test_a_segment_that_cannot_be_started_fails_that_request_only(tmp_path, monkeypatch):
    """Out of file descriptors as a segment rotates: that request is refused, the next ones are
    journaled (the journal had already closed its file and moved on, so its thread died on the next
    write and every later request waited for an answer for good)."""
    import builtins
    import errno

    from collector.live import journal as journal_module
    spans = decode.decode_request(export_request(record([SCENARIOS["pass"][0]])[0]),
                                  CollectorConfig().matcher()).spans
    failing = [False]

    def open_(*args: Any, **kwargs: Any):
        if failing[0]:
            failing[0] = False
            raise OSError(errno.EMFILE, "Too many open files")
        return builtins.open(*args, **kwargs)

    monkeypatch.setattr(journal_module, "open", open_, raising=False)

    async def scenario() -> None:
        journal = Journal(tmp_path, 1, 1 << 30)  # every request starts a segment
        journal.start()
        try:
            await journal.append(spans[:1])
            failing[0] = True
            with pytest.raises(journal_module.JournalError, match="Too many open files"):
                await journal.append(spans[1:2])
            await asyncio.wait_for(journal.append(spans[2:3]), 10)
            on_disk = [s.span_id for p in sorted(tmp_path.glob("*.jsonl"))
                       for s in journal_decode(p.read_bytes(), CollectorConfig().matcher())]
            assert on_disk == [spans[0].span_id, spans[2].span_id]  # the refused one is retried by its client
        finally:
            journal.close()

    asyncio.run(scenario())


def test_a_clean_close_names_what_it_kept_and_a_crash_after_it_loses_nothing_new(tmp_path):
    """A clean close keeps the segment of a trace still needed (a) beside the records of one done (b)
    and names a in its manifest: the next start replays a alone. What that start journals (c) is
    past the manifest's segments: a kill -9 then replays it whole, a still filtered, b never."""
    matcher = CollectorConfig().matcher()
    a, b, c = (decode.decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), matcher).spans
               for _ in range(3))
    traces = {name: spans[0].trace_id for name, spans in (("a", a), ("b", b), ("c", c))}

    def replayed(journal: Journal) -> set[str]:
        return {name for batch in journal.replay(matcher) for s in batch for name, t in traces.items()
                if s.trace_id == t}

    async def first() -> None:
        journal = Journal(tmp_path, 1 << 20, 1 << 30)
        journal.start()
        await journal.append(a + b)  # one request, one line
        journal.release([(traces["b"], journal.mark())])
        journal.close()

    async def second() -> None:
        journal = Journal(tmp_path, 1 << 20, 1 << 30)
        journal.start()
        assert replayed(journal) == {"a"}
        await journal.append(c)
        journal._lock_file.close()  # killed: no close, no new manifest

    asyncio.run(first())
    assert (tmp_path / "KEPT.json").exists()
    asyncio.run(second())
    journal = Journal(tmp_path, 1 << 20, 1 << 30)
    journal.start()
    try:
        assert replayed(journal) == {"a", "c"}
        journal.release([(traces["a"], journal.mark()), (traces["c"], journal.mark())])
    finally:
        journal.close()
    assert not list(tmp_path.glob("*.jsonl")) and not (tmp_path / "KEPT.json").exists()


def test_a_manifest_says_when_each_kept_trace_was_first_cut(tmp_path):
    """The close names, of the first cuts it is given, those of the traces it keeps; the next start
    reads them back. A manifest of the previous version (no first cuts) still names its traces."""
    matcher = CollectorConfig().matcher()
    a, b = (decode.decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), matcher).spans
            for _ in range(2))

    async def first() -> None:
        journal = Journal(tmp_path, 1 << 20, 1 << 30)
        journal.start()
        await journal.append(a + b)
        journal.release([(b[0].trace_id, journal.mark())])
        journal.cut({a[0].trace_id: 1000.5, b[0].trace_id: 2000.0})
        journal.close()

    asyncio.run(first())
    manifest = json.loads((tmp_path / "KEPT.json").read_text())
    assert manifest["first_cut"] == {a[0].trace_id.hex(): 1000.5}
    journal = Journal(tmp_path, 1 << 20, 1 << 30)
    journal.start()
    assert (journal.kept, journal.first_cut) == ({a[0].trace_id}, {a[0].trace_id: 1000.5})
    journal.close()
    for nonsense in ("nan", "inf"):  # would pin the trace for good
        (tmp_path / "KEPT.json").write_text(json.dumps({**manifest, "first_cut": {a[0].trace_id.hex(): nonsense}}))
        journal = Journal(tmp_path, 1 << 20, 1 << 30)
        journal.start()
        assert journal.first_cut == {}
        journal.close()
    ahead = time.time() + 3600  # a clock stepped back: the pin would last an hour longer
    (tmp_path / "KEPT.json").write_text(json.dumps({**manifest, "first_cut": {a[0].trace_id.hex(): ahead}}))
    journal = Journal(tmp_path, 1 << 20, 1 << 30)
    journal.start()
    assert journal.first_cut[a[0].trace_id] <= time.time()
    journal.close()
    del manifest["first_cut"]
    (tmp_path / "KEPT.json").write_text(json.dumps(manifest))
    journal = Journal(tmp_path, 1 << 20, 1 << 30)
    journal.start()
    try:
        assert (journal.kept, journal.first_cut) == ({a[0].trace_id}, {})
        assert {s.trace_id for batch in journal.replay(matcher) for s in batch} == {a[0].trace_id}
    finally:
        journal.close()


def test_a_manifest_whose_segments_are_gone_hides_nothing_written_later(tmp_path):
    """The kept segment deleted by hand (or let go after the close, by a store write finishing late),
    the manifest left: the next start drops it and numbers its segments past it, so a kill -9 after
    that start still replays what it wrote."""
    matcher = CollectorConfig().matcher()
    a, c = (decode.decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), matcher).spans
            for _ in range(2))

    async def first() -> None:
        journal = Journal(tmp_path, 1 << 20, 1 << 30)
        journal.start()
        await journal.append(a)
        journal.close()

    async def second() -> None:
        journal = Journal(tmp_path, 1 << 20, 1 << 30)
        journal.start()
        assert not list(journal.replay(matcher))
        await journal.append(c)
        journal._lock_file.close()  # killed

    asyncio.run(first())
    (segment,) = tmp_path.glob("*.jsonl")
    segment.unlink()
    assert (tmp_path / "KEPT.json").exists()
    asyncio.run(second())
    journal = Journal(tmp_path, 1 << 20, 1 << 30)
    journal.start()
    try:
        assert [s.span_id for batch in journal.replay(matcher) for s in batch] == [s.span_id for s in c]
    finally:
        journal.close()


# --- the journal's own faults: a full disk, its directory deleted ------------------------------------

def whole_traces(n: int, per_request: int = 1) -> list[tuple[list[tuple[str, str]], bytes]]:
    """``n`` traces of varied scenarios in requests of ``per_request`` whole traces, each request as
    ([(trace id, scenario)], the OTLP request)."""
    names = [sorted(CRASH_SCENARIOS)[i % len(CRASH_SCENARIOS)] for i in range(n)]
    spans, ids = record([SCENARIOS[name][0] for name in names])
    by_trace: dict[str, list] = {}
    for span in spans:
        by_trace.setdefault(format(span.context.trace_id, "032x"), []).append(span)
    traces = list(zip(ids, names, strict=True))
    return [(traces[i:i + per_request],
             export_request([s for tid, _ in traces[i:i + per_request] for s in by_trace[tid]]).SerializeToString())
            for i in range(0, n, per_request)]


def send(proc: CollectorProcess, body: bytes, on_refusal: Any = None, tries: int = 20) -> tuple[bool, int]:
    """POST one request like an OTLP exporter, retrying retryable answers (``on_refusal`` is called
    before each retry); returns whether it was acknowledged and how many times it was refused."""
    for refused in range(tries):
        status, answer, _ = post(proc.http, body)
        if status == 200:
            return True, refused
        assert status in RETRYABLE_HTTP, f"HTTP {status}: {answer[:300]!r}"  # never a final answer
        if on_refusal is not None:
            on_refusal()
        time.sleep(0.05)
    return False, tries


def stored_of(proc: CollectorProcess, acked: list[tuple[str, str]]) -> dict[str, str]:
    """Of the acknowledged traces, what is wrong with each one not stored exactly once as expected
    (waiting for the replayed ones to complete)."""
    deadline = time.monotonic() + 30
    while True:
        rows = runs_by_trace(proc.store_path)
        wrong = {tid: p for tid, name in acked if (p := problems(CrashTrace(tid, name, []), rows.get(tid, [])))}
        if not wrong or time.monotonic() > deadline:
            return wrong
        time.sleep(0.2)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: a disk that really fills up (ENOSPC mid-write, a page's slack taken first)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk) -> int:
    """Fill the disk to the last byte; returns the filler's descriptor."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    chunk = b"x" * 65536
    while chunk:
        try:
            os.write(fd, chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            chunk = chunk[: len(chunk) // 2]
    return fd


WRITE_PAST_A_LIMIT = """
import asyncio, os, pickle, resource, sys
from pathlib import Path
from collector.live.journal import Journal, JournalError

directory = Path(sys.argv[1])
a, b, c = pickle.loads(directory.joinpath("spans.pickle").read_bytes())

async def main() -> None:
    journal = Journal(directory, 1 << 20, 1 << 30)
    journal.start()
    await journal.append(a)
    (segment,) = directory.glob("*.jsonl")
    resource.setrlimit(resource.RLIMIT_FSIZE, (segment.stat().st_size + 100, resource.RLIM_INFINITY))
    try:
        await journal.append(b)  # 100 bytes of it written, then EFBIG
        print("acknowledged")
    except JournalError:
        print("refused")
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    await journal.append(c)
    os._exit(0)  # killed: no close

asyncio.run(main())
"""


def test_a_write_that_fails_partway_is_refused_and_cut_off_so_the_next_record_replays(tmp_path):
    """A write cut short (RLIMIT_FSIZE in a process of its own: EFBIG after part of the record, as on
    a full disk, without root): that request is refused and the next one, acknowledged, replays.
    Before, the next record was appended to the part written and was unreadable on replay."""
    matcher = CollectorConfig().matcher()
    a, b, c = (decode.decode_request(export_request(record([SCENARIOS["loop"][0]] * n)[0]), matcher).spans
               for n in (1, 4, 1))  # b: over the 8 KiB a buffered file writes in one go
    (tmp_path / "spans.pickle").write_bytes(pickle.dumps((a, b, c)))
    done = subprocess.run([sys.executable, "-c", WRITE_PAST_A_LIMIT, str(tmp_path)], capture_output=True, text=True)
    assert (done.returncode, done.stdout.splitlines()[-1:]) == (0, ["refused"]), done.stdout[-2000:] + done.stderr
    journal = Journal(tmp_path, 1 << 20, 1 << 30)
    journal.start()
    try:
        assert [s.span_id for batch in journal.replay(matcher) for s in batch] == [s.span_id for s in a + c]
    finally:
        journal.close()


def test_a_full_disk_refuses_the_request_it_cuts_short_and_loses_no_acknowledged_trace(tmp_path, small_disk):
    """The journal's disk fills up mid-request: that request is refused (retryably) and whatever of it
    reached the segment is cut off, so once there is room again the next record starts whole. Before,
    the part written stayed and the next acknowledged record was appended to it, unreadable on replay
    (journal_record_skipped): that trace was lost at the next kill -9."""
    journal = {"journal": {"path": str(small_disk / "journal")}}
    first = CollectorProcess(tmp_path, overrides={**LONG, **journal})
    requests = whole_traces(200, per_request=4)  # over the 8 KiB a buffered file writes in one go
    acked, refusals, filler = [], 0, None

    def make_room() -> None:
        nonlocal filler
        if filler is not None:
            os.close(filler)
            (small_disk / "filler").unlink()
            filler = None

    try:
        for i, (traces, body) in enumerate(requests):
            if i == len(requests) // 2:
                filler = fill(small_disk)
            ok, refused = send(first, body, make_room)
            assert ok, f"request {i} refused {refused} times with room on the disk"
            acked += traces
            refusals += refused
        failed = [e for e in first.log_events() if e.get("event") == "journal_write_failed"]
        assert refusals >= 1 and failed and "No space left" in failed[0]["error"]  # the disk did fill up
    finally:
        make_room()
        first.stop(signal.SIGKILL)
    second = CollectorProcess(tmp_path, overrides=journal)
    try:
        wrong = stored_of(second, acked)
        skipped = [e for e in second.log_events() if e.get("event") == "journal_record_skipped"]
        assert not wrong and not skipped, (f"{len(acked) - len(wrong)} of {len(acked)} acknowledged traces stored "
                                           f"after a full disk and a kill -9; {len(skipped)} journal records skipped: "
                                           f"{list(wrong.items())[:5]}")
    finally:
        assert second.stop() == 0


def test_a_deleted_journal_directory_is_made_again_and_loses_no_acknowledged_trace(tmp_path):
    """``rm -rf`` of the journal directory under a running collector: the next request finds its
    segment gone, the directory is made again (one log line) with every segment still needed copied
    back from its open file, and requests are journaled there, so a kill -9 loses none. Before, they
    were written to the deleted file (all lost at the kill -9), and from the next segment on every
    request was refused until a restart."""
    directory = tmp_path / "runs.db.journal"
    small = {**LONG, "journal": {"segment_bytes": 20000}}  # a new segment every few traces
    first = CollectorProcess(tmp_path, overrides=small)
    requests = whole_traces(70)
    acked = []
    try:
        for i, (traces, body) in enumerate(requests):
            if i == 20:
                shutil.rmtree(directory)
            ok, _ = send(first, body)
            if not ok:
                break
            acked += traces
        recreated = [e for e in first.log_events() if e.get("event") == "journal_directory_recreated"]
    finally:
        first.stop(signal.SIGKILL)
    second = CollectorProcess(tmp_path)
    try:
        wrong = stored_of(second, acked)
        assert not wrong and len(acked) == len(requests), (
            f"{len(acked) - len(wrong)} of {len(acked)} acknowledged traces stored after rm -rf of the journal and "
            f"a kill -9 ({len(requests) - len(acked)} of {len(requests)} refused for good): {list(wrong.items())[:5]}")
        assert len(recreated) == 1 and recreated[0]["segments"] >= 2, recreated
    finally:
        assert second.stop() == 0


def test_a_journal_directory_deleted_before_a_clean_stop_keeps_the_trace_it_cut(tmp_path):
    """``rm -rf`` of the journal directory, then a rolling restart (SIGTERM) with a trace cut short:
    the close makes the directory again with that trace's segment and its manifest, so the next
    collector reconciles the trace whole when its workflow-run span comes. Before, the close wrote
    into a directory that was gone: the next collector had the workflow-run span alone, and only the
    first collector's incomplete run was stored."""
    spans, (trace_id,) = record([SCENARIOS["fail_under_report"][0]])
    _, status, units = SCENARIOS["fail_under_report"]
    first = CollectorProcess(tmp_path, overrides={"assembly": {"max_trace_wait": 60}})
    export_spans(first, [s for s in spans if s.parent is not None])  # acknowledged: journaled
    shutil.rmtree(tmp_path / "runs.db.journal")
    assert first.stop() == 0  # the trace is cut short, stored incomplete, kept for its rest
    second = CollectorProcess(tmp_path, overrides={"assembly": {"max_trace_wait": 60}})
    try:
        export_spans(second, [s for s in spans if s.parent is None])
        deadline = time.monotonic() + 15
        while (doc := second.store().get_run(run_id(trace_id))) is None or doc["incomplete"]:
            assert time.monotonic() < deadline, f"never stored complete: {doc}"
            time.sleep(0.1)
        assert (doc["status"], {e["executor_id"]: e["verdict"] for e in doc["executors"]}) == (status, units)
    finally:
        assert second.stop() == 0
