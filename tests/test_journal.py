"""The crash journal (DESIGN §3 Durability): what a 200 means is that the spans are on disk."""

from __future__ import annotations

import signal
import subprocess
import time

from conftest import AGENTEVAL, CollectorProcess, export_spans, post
from mafshape import SCENARIOS, export_request, record, run_id

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


def test_the_journal_holds_span_records_never_prompt_text(tmp_path):
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])  # its chat spans carry SECRET-PROMPT / SECRET-ANSWER
    proc = CollectorProcess(tmp_path, overrides=LONG)
    try:
        export_spans(proc, spans)
        (segment,) = segments(proc)
        text = segment.read_text()
        assert trace_id in text and "gen_ai.usage.input_tokens" in text
        assert "SECRET" not in text and "gen_ai.input.messages" not in text
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
    try:
        second = subprocess.run([AGENTEVAL, "collector", "serve", "--config", str(first.config_path)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "journal in use by another collector" in second.stderr
    finally:
        first.stop()
    off = CollectorProcess(tmp_path / "off", overrides={"journal": {"enabled": False}})
    try:
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        assert post(off.http, export_request(spans).SerializeToString())[0] == 200
        assert off.run(trace_id)["status"] == "PASS"
        assert not (off.store_path.parent / "runs.db.journal").exists()
    finally:
        off.stop()


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
