"""The Kafka topology run for real (docs/scale-out.md "Kafka, exact"): an Apache Kafka broker (KRaft,
from Maven Central: `make kafka`), our OpenTelemetry Collector distribution with the `kafka` exporter
on config/otelcol-kafka.yaml in front, and agenteval replicas consuming the topic as one consumer
group, sharing one PostgreSQL.

MAF-shaped traces (tests/mafshape.py, each with a known verdict) are exported by the real OTLP SDK
exporter the way an application does: each trace's spans over several seconds, children first, the
workflow-run root last, many traces in flight at once. Replicas join, leave with SIGTERM, and are
killed with SIGKILL and restarted mid-load; every trace must end as exactly one stored run with the
verdict one replica alone gives it. Beside it: a partition taken over mid-trace (the commit's
metadata keeps the next owner from publishing the tail of a trace already stored, which offsets
alone would not), messages that are not OTLP or too large, and a broker outage."""

from __future__ import annotations

import heapq
import json
import random
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from collector.store import unpack

from conftest import CollectorProcess
from kafka import broker_or_reason, require
from mafshape import SCENARIOS, export_request, record, run_id
from test_scaleout import ROOT, Acked, Otelcol, otelcol_built, stored_runs, wait_stored  # otelcol_built: a fixture

CONFIG = ROOT / "config/otelcol-kafka.yaml"
PARTITIONS = 6
SEED = 20261206
#: Replica settings: a trace is complete 2 s after its last span (its spans come at most ~1 s
#: apart), one without its root is never cut short by a wait in the test, and a replica that is
#: killed leaves the group 3 s later (session timeout).
ASSEMBLY = {"quiet_period": 2.0, "max_trace_wait": 120.0, "late_window": 120.0, "sweep_interval": 0.1}
CLIENT = {"session.timeout.ms": 3000, "heartbeat.interval.ms": 500}


@pytest.fixture(scope="module")
def kafka_broker():
    broker, why = broker_or_reason()
    if broker is None:
        require(why)
    yield broker
    broker.destroy()


_topics = iter(range(1_000_000))


def new_topic(broker, partitions: int = PARTITIONS) -> str:
    name = f"otlp_spans_{next(_topics)}"
    broker.create_topic(name, partitions)
    return name


@dataclass
class Replica:
    """One agenteval replica in the consumer group, across restarts (a CollectorProcess a life)."""

    name: str
    root: Path
    store_url: str
    kafka: dict
    lives: list[CollectorProcess] = field(default_factory=list)

    def start(self) -> Replica:
        overrides = {"receivers": {"grpc": {"enabled": False}, "kafka": {"enabled": True, **self.kafka}},
                     "assembly": ASSEMBLY, "journal": {"enabled": False}}
        self.lives.append(CollectorProcess(self.root / f"life{len(self.lives)}", overrides,
                                           env={"AGENTEVAL_INSTANCE": self.name}, store_url=self.store_url))
        return self

    @property
    def current(self) -> CollectorProcess:
        return self.lives[-1]

    def events(self, name: str) -> list[dict]:
        return [e for life in self.lives for e in life.log_events() if e.get("event") == name]

    def wait_for(self, name: str, timeout: float = 60.0, count: int = 1) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(found := self.events(name)) < count:
            assert time.monotonic() < deadline, f"{self.name}: no {name} in {timeout:g} s:\n" + \
                self.current.stderr_path.read_text()[-3000:]
            time.sleep(0.1)
        return found

    def kill_9(self) -> None:
        self.current.proc.send_signal(signal.SIGKILL)
        self.current.stop()


def group(tmp: Path, url: str, broker, topic: str, names: list[str], **kafka) -> list[Replica]:
    settings = {"brokers": [broker.bootstrap], "topic": topic, "group_id": topic, "client": CLIENT, **kafka}
    return [Replica(name, tmp / name, url, settings) for name in names]


# --- the load: traces exported over seconds, as an application does -----------------------------

@dataclass
class Traffic:
    spans: dict[str, list[ReadableSpan]]  # by trace id, in finish order (root last)
    scenario: dict[str, str]


def make_traffic(traces: int, seed: int = SEED) -> Traffic:
    names = [random.Random(seed + i).choice(sorted(SCENARIOS)) for i in range(traces)]
    spans, ids = record([SCENARIOS[name][0] for name in names])
    by_trace: dict[str, list[ReadableSpan]] = {tid: [] for tid in ids}
    for span in spans:
        by_trace[format(span.context.trace_id, "032x")].append(span)
    return Traffic(by_trace, dict(zip(ids, names, strict=True)))


class PacedLoad:
    """Each trace's spans handed to the SDK's BatchSpanProcessor one by one over ``spread`` seconds
    (uniform, per trace), trace starts spread over ``duration`` seconds: at any moment many traces
    are in flight, each with its root still to come."""

    def __init__(self, endpoint: str, traffic: Traffic, duration: float, spread: tuple[float, float],
                 senders: int = 2, seed: int = SEED) -> None:
        rng = random.Random(seed)
        self.exporters = [Acked(endpoint) for _ in range(senders)]
        self.processors = [BatchSpanProcessor(e, schedule_delay_millis=50, max_export_batch_size=128)
                           for e in self.exporters]
        self.window: dict[str, tuple[float, float]] = {}  # trace -> (first span, root) offsets in seconds
        events = []
        for i, (tid, spans) in enumerate(traffic.spans.items()):
            start = rng.uniform(0, duration)
            length = rng.uniform(*spread)
            step = length / max(1, len(spans) - 1)
            self.window[tid] = (start, start + length)
            events.extend((start + k * step, i, k, tid, span) for k, span in enumerate(spans))
        heapq.heapify(events)
        self._events = events
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._events:
            due, i, _, _, span = heapq.heappop(self._events)
            delay = self.started + due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.processors[i % len(self.processors)].on_end(span)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def wait_until(self, offset: float) -> float:
        """Sleep until ``offset`` seconds into the load; returns the offset reached."""
        time.sleep(max(0.0, self.started + offset - time.monotonic()))
        return self.elapsed()

    def in_flight(self, at: float) -> set[str]:
        """Traces with spans sent and their root not yet sent at ``at`` seconds into the load."""
        return {tid for tid, (first, root) in self.window.items() if first <= at < root}

    def finish(self) -> None:
        self._thread.join()
        for processor in self.processors:
            processor.shutdown()


def unit_verdicts(url: str) -> dict[str, dict[str, str]]:
    """trace id -> {executor: verdict} of its stored run (the last one read, if several)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT trace_id, body FROM runs").fetchall()
    return {tid: {e["executor_id"]: e["verdict"] for e in json.loads(unpack(body))["executors"]} for tid, body in rows}


def check_exact(url: str, traffic: Traffic) -> None:
    """Every trace is one stored run, complete, with exactly its scenario's status and unit verdicts."""
    runs = wait_stored(url, traffic.spans)
    units = unit_verdicts(url)
    wrong = {}
    for tid, scenario in traffic.scenario.items():
        _, status, verdicts = SCENARIOS[scenario]
        got = runs.get(tid, [])
        if ([(r["run_id"], r["incomplete"], r["status"]) for r in got] != [(run_id(tid), False, status)]
                or units.get(tid) != verdicts):
            wrong[tid] = (scenario, got, units.get(tid))
    assert not wrong, f"{len(wrong)} of {len(traffic.spans)} traces stored wrong, e.g. {list(wrong.items())[:3]}"


# --- the tests ------------------------------------------------------------------------------------

def test_the_kafka_config_validates_with_our_distribution(otelcol_built: Path) -> None:
    import subprocess

    result = subprocess.run([str(otelcol_built), "validate", f"--config={CONFIG}"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_trace_one_exact_run_through_scale_up_sigterm_and_kill_9(otelcol_built, kafka_broker, postgres,
                                                                      tmp_path):
    """Two replicas; mid-load a third joins, one leaves with SIGTERM, one is killed with SIGKILL and
    restarted with the same group id. Every trace in flight at each change is still one run with
    its one-replica verdict."""
    url = postgres.database()
    topic = new_topic(kafka_broker)
    a, b, c = group(tmp_path, url, kafka_broker, topic, ["agenteval-a", "agenteval-b", "agenteval-c"])
    a.start(), b.start()
    otelcol = Otelcol([CONFIG], tmp_path / "otelcol.log",
                      {"KAFKA_BROKERS": f"[{kafka_broker.bootstrap}]", "KAFKA_TOPIC": topic,
                       "OTELCOL_RETRY_INITIAL_INTERVAL": "100ms", "OTELCOL_RETRY_MAX_INTERVAL": "500ms"})
    traffic = make_traffic(240)
    try:
        a.wait_for("kafka_partitions_assigned"), b.wait_for("kafka_partitions_assigned")
        load = PacedLoad(otelcol.grpc, traffic, duration=24.0, spread=(3.0, 6.0))
        # Each change is made on time and not waited for (a start or a stop takes seconds on a busy
        # box), so the changes fall where traces are in flight.
        events, starting = {}, []
        events["scale up"] = load.wait_until(7.0)
        starting.append(threading.Thread(target=c.start))
        starting[-1].start()
        events["SIGTERM"] = load.wait_until(13.0)
        b.current.proc.send_signal(signal.SIGTERM)
        events["kill -9"] = load.wait_until(19.0)
        a.kill_9()
        starting.append(threading.Thread(target=a.start))  # the same group id: it resumes where the group is
        starting[-1].start()
        load.finish()
        for thread in starting:
            thread.join()
        assert b.current.stop() == 0
        assert {(s.context.trace_id, s.context.span_id) for ss in traffic.spans.values() for s in ss} == \
            set().union(*(e.acked for e in load.exporters))
        check_exact(url, traffic)
    finally:
        otelcol.stop()
        for replica in (a, b, c):
            if replica.lives:
                replica.current.stop()
    in_flight = {name: len(load.in_flight(at)) for name, at in events.items()}
    assert all(n >= 20 for n in in_flight.values()), f"too few traces in flight at the changes: {in_flight}"
    # The changes were real: partitions moved at each, and open traces were dropped for their next owner.
    assert c.events("kafka_partitions_assigned") and b.events("kafka_receiver_stopped")
    assert len(a.lives) == 2 and a.lives[1].log_events()
    dropped = sum(e["dropped_open_traces"] for r in (a, b, c) for e in r.events("kafka_partitions_revoked"))
    dropped += sum(e["dropped_open_traces"] for r in (a, b, c) for e in r.events("kafka_receiver_stopped"))
    assert dropped > 0, "no replica held an open trace at a change: the test did not exercise a hand-over"


def _produce(broker, topic: str, messages: list[bytes]) -> None:
    from confluent_kafka import Producer

    producer = Producer(broker.client())
    for value in messages:
        producer.produce(topic, value, partition=0)
    assert producer.flush(30) == 0


def _request(spans) -> bytes:
    return export_request(spans).SerializeToString()


@pytest.mark.parametrize("metadata", ["named", "offsets_only"])
def test_a_partition_taken_over_mid_trace_never_publishes_a_stored_traces_tail(kafka_broker, postgres, tmp_path,
                                                                              metadata):
    """One partition: the first part of FAIL trace Y, then trace X without its root, then the rest
    of Y. Replica A stores Y (FAIL) while X waits for its root; A stops (SIGTERM): its commit stays
    at X (not yet stored). B re-reads from there: X whole, and Y's tail, which without Y's first
    part is a clean-looking run. The commit's metadata names Y as stored, so B skips it; with
    offsets alone (no metadata) B publishes that tail."""
    url = postgres.database()
    topic = new_topic(kafka_broker, 1)
    extra = {"max_metadata_bytes": 0} if metadata == "offsets_only" else {}
    a, b = group(tmp_path, url, kafka_broker, topic, ["agenteval-a", "agenteval-b"], **extra)
    traffic = make_traffic_from({"x": "pass", "y": "fail_under_report"})
    (x, xs), (y, ys) = traffic.spans.items()
    # Y's under-reporting writer ran first: its spans go in Y's first part.
    writer = [s for s in ys if s.attributes.get("executor.id") == "writer" or _under(s, ys, "writer")]
    rest = [s for s in ys if s not in writer]
    a.start()
    try:
        a.wait_for("kafka_partitions_assigned")
        _produce(kafka_broker, topic, [_request(writer), _request(xs[:-1]), _request(rest)])
        stored = wait_stored(url, [y], timeout=60)
        assert [r["status"] for r in stored[y]] == ["FAIL"]
        assert a.current.stop() == 0
        assert not [e for e in a.events("run_verdict") if e["trace_id"] == x], "A published X's open part"
        b.start()
        b.wait_for("kafka_partitions_assigned")
        _produce(kafka_broker, topic, [_request(xs[-1:])])
        runs = wait_stored(url, [x], timeout=60)
        assert [(r["status"], r["incomplete"], r["finalized_by"]) for r in runs[x]] == [("PASS", False, "agenteval-b")]
        time.sleep(ASSEMBLY["quiet_period"] + 1)  # Y's tail, had B taken it, would be published by now
        tails = [e for e in b.events("run_verdict") if e["trace_id"] == y]
    finally:
        for replica in (a, b):
            if replica.lives:
                replica.current.stop()
    if metadata == "named":
        assert tails == [], f"B published a tail of stored trace Y: {tails}"
        assert b.events("kafka_partitions_assigned")[0]["skipped_traces"] == {"0": 1}
    else:  # the defect the metadata prevents, seen: a clean-looking run of Y without its writer
        assert tails and tails[0]["status"] == "PASS" and "writer" not in tails[0]["executors"], tails
    # Whatever B did, the stored run of Y is A's whole FAIL run.
    assert [(r["status"], r["finalized_by"]) for r in stored_runs(url)[y]] == [("FAIL", "agenteval-a")]


def make_traffic_from(scenarios: dict[str, str]) -> Traffic:
    """One trace per named scenario, in order (ids assigned by the SDK)."""
    names = list(scenarios.values())
    spans, ids = record([SCENARIOS[name][0] for name in names])
    by_trace: dict[str, list[ReadableSpan]] = {tid: [] for tid in ids}
    for span in spans:
        by_trace[format(span.context.trace_id, "032x")].append(span)
    return Traffic(by_trace, dict(zip(ids, names, strict=True)))


def _under(span: ReadableSpan, spans: list[ReadableSpan], executor: str) -> bool:
    """Whether ``span`` is in the subtree of ``executor``'s executor span."""
    by_id = {s.context.span_id: s for s in spans}
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        if span.attributes.get("executor.id") == executor:
            return True
    return False


def test_bad_messages_are_counted_skipped_and_never_block_their_partition(kafka_broker, tmp_path):
    topic = new_topic(kafka_broker, 1)
    replica = Replica("agenteval-a", tmp_path / "a", str(tmp_path / "runs.db"),
                      {"brokers": [kafka_broker.bootstrap], "topic": topic, "group_id": topic, "client": CLIENT,
                       "max_message_bytes": 20_000}).start()
    traffic = make_traffic_from({"p1": "pass", "p2": "fail_under_report"})
    (first, first_spans), (second, second_spans) = traffic.spans.items()
    big = make_traffic(60, seed=3)
    oversize = _request([s for spans in big.spans.values() for s in spans])
    assert len(oversize) > 20_000
    try:
        replica.wait_for("kafka_partitions_assigned")
        _produce(kafka_broker, topic, [_request(first_spans), b"\x0a\xffnot OTLP", oversize, b"",
                                       _request(second_spans)])
        assert replica.current.run(first, timeout=60)["status"] == "PASS"
        assert replica.current.run(second, timeout=60)["status"] == "FAIL"
        skipped = replica.wait_for("kafka_message_skipped", count=2)
        metrics = replica.current.metrics()
    finally:
        replica.current.stop()
    assert sorted((e["reason"], e["partition"], e["offset"]) for e in skipped) == [
        ("too_large", 0, 2), ("undecodable", 0, 1)]
    assert metrics[("agenteval_kafka_messages_skipped_total", (("reason", "undecodable"),))] == 1
    assert metrics[("agenteval_kafka_messages_skipped_total", (("reason", "too_large"),))] == 1
    assert not [e for e in replica.events("run_verdict") if e["trace_id"] in big.spans]


def test_over_capacity_consumption_pauses_and_rereads_skipping_nothing(kafka_broker, tmp_path):
    """A replica whose assembly holds far fewer spans than the topic carries refuses (Backpressure),
    pauses its partitions and reads the refused messages again: every trace is stored, right."""
    topic = new_topic(kafka_broker, 2)
    traffic = make_traffic(40, seed=5)
    largest = max(len(spans) for spans in traffic.spans.values())
    kafka = {"enabled": True, "brokers": [kafka_broker.bootstrap], "topic": topic, "group_id": topic, "client": CLIENT}
    overrides = {"receivers": {"grpc": {"enabled": False}, "kafka": kafka},
                 "assembly": {**ASSEMBLY, "quiet_period": 0.5, "max_spans_in_flight": 2 * largest,
                              "retry_after": 0.2},
                 "journal": {"enabled": False}}
    from confluent_kafka import Producer

    producer = Producer(kafka_broker.client())
    for spans in traffic.spans.values():
        producer.produce(topic, _request(spans), key=spans[0].context.trace_id.to_bytes(16, "big"))
    assert producer.flush(30) == 0
    life = CollectorProcess(tmp_path / "tight", overrides, env={"AGENTEVAL_INSTANCE": "agenteval-a"})
    try:
        for tid, scenario in traffic.scenario.items():
            doc = life.run(tid, timeout=90)
            assert (doc["status"], doc["incomplete"]) == (SCENARIOS[scenario][1], False)
        refused = life.metrics()[("agenteval_spans_refused_total", (("reason", "capacity"), ("transport", "kafka")))]
    finally:
        life.stop()
    assert refused > 0, "the replica never refused: the test did not exercise the pause"
    assert not [e for e in life.log_events() if e.get("event") == "kafka_message_skipped"]


def test_a_broker_outage_keeps_reads_working_and_loses_nothing(kafka_broker, tmp_path):
    """The broker stops with traces half-sent; the run page and the API keep answering; the rest
    of the traces, produced during the outage (the producer buffers them), are reconciled whole
    once it is back; a replica restarted with the same group id then reconciles nothing twice."""
    from confluent_kafka import Producer

    topic = new_topic(kafka_broker, 2)
    replica = Replica("agenteval-a", tmp_path / "a", str(tmp_path / "runs.db"),
                      {"brokers": [kafka_broker.bootstrap], "topic": topic, "group_id": topic, "client": CLIENT})
    replica.start()
    before = make_traffic(4, seed=11)
    during = make_traffic(4, seed=12)
    producer = Producer({**kafka_broker.client(), "message.timeout.ms": 120_000})
    try:
        replica.wait_for("kafka_partitions_assigned")
        for spans in before.spans.values():
            producer.produce(topic, _request(spans), key=spans[0].context.trace_id.to_bytes(16, "big"))
        for spans in during.spans.values():  # all but their roots
            producer.produce(topic, _request(spans[:-1]), key=spans[0].context.trace_id.to_bytes(16, "big"))
        assert producer.flush(30) == 0
        for tid, scenario in before.scenario.items():
            assert replica.current.run(tid, timeout=60)["status"] == SCENARIOS[scenario][1]
        kafka_broker.stop()
        for spans in during.spans.values():  # the roots, buffered by the producer while the broker is down
            producer.produce(topic, _request(spans[-1:]), key=spans[0].context.trace_id.to_bytes(16, "big"))
        producer.poll(0)
        time.sleep(2)
        with urllib.request.urlopen(f"{replica.current.http}/runs", timeout=10) as page:
            assert page.status == 200 and next(iter(before.spans)) in page.read().decode()
        with urllib.request.urlopen(f"{replica.current.http}/healthz", timeout=10) as health:
            assert health.status == 200
        kafka_broker.start()
        assert producer.flush(60) == 0
        for tid, scenario in during.scenario.items():
            doc = replica.current.run(tid, timeout=90)
            assert (doc["status"], doc["incomplete"]) == (SCENARIOS[scenario][1], False)
        assert replica.current.stop() == 0
        replica.start()  # same group id: resumes after what is stored, re-reconciles nothing
        replica.wait_for("kafka_partitions_assigned", count=2)
        time.sleep(ASSEMBLY["quiet_period"] + 1)
        assert replica.lives[1].log_events() and not [e for e in replica.lives[1].log_events()
                                                      if e.get("event") == "run_verdict"]
    finally:
        if kafka_broker.proc is None or kafka_broker.proc.poll() is not None:
            kafka_broker.start()
        replica.current.stop()


# --- the commit's promise, without a broker (collector/live/receivers/kafka_offsets.py) ---------------

class _Span:
    def __init__(self, trace_id: bytes) -> None:
        self.trace_id = trace_id


def _append(offsets, partition: int, offset: int, *traces: bytes) -> None:
    offsets.append([_Span(t) for t in traces], at=(partition, offset))
    offsets.taken(partition, offset)


def test_the_commit_stays_at_the_oldest_unstored_trace_and_names_the_stored_ones_past_it():
    from collector.live.receivers.kafka_offsets import KafkaOffsets, decode_metadata

    x, y, z = (bytes([n]) * 16 for n in (1, 2, 3))
    offsets = KafkaOffsets(4096)
    offsets.assign(0, None, None)
    _append(offsets, 0, 0, y)        # Y's first part
    _append(offsets, 0, 1, x)        # X, its root still to come
    _append(offsets, 0, 2, y, z)     # the rest of Y, and all of Z, in one message
    assert offsets.commit_point(0).offset == 0
    offsets.release([(y, offsets.mark()), (z, offsets.mark())])  # Y and Z stored
    point = offsets.commit_point(0)
    assert point.offset == 1 and decode_metadata(point.metadata) == {y[:8], z[:8]}
    assert offsets.pending_traces(0) == {x}
    _append(offsets, 0, 3, x)        # X's root
    offsets.release([(x, offsets.mark())])
    point = offsets.commit_point(0)
    assert (point.offset, point.metadata) == (4, "")  # everything before 4 is stored: nothing to name


def test_a_late_span_of_a_stored_trace_holds_the_commit_until_its_revision_is_stored():
    from collector.live.receivers.kafka_offsets import KafkaOffsets, decode_metadata

    x, y = bytes([1]) * 16, bytes([2]) * 16
    offsets = KafkaOffsets(4096)
    offsets.assign(0, None, None)
    _append(offsets, 0, 0, x)
    settled = offsets.mark()
    _append(offsets, 0, 1, y)
    _append(offsets, 0, 2, x)        # a late span of X after X was settled
    offsets.release([(x, settled)])  # X's first revision stored: only what came before it is done
    assert offsets.commit_point(0).offset == 1
    offsets.release([(y, offsets.mark())])
    point = offsets.commit_point(0)
    assert point.offset == 2 and decode_metadata(point.metadata) == set()  # X is not done: not named


def test_the_next_owner_skips_the_named_traces_and_keeps_naming_them_while_they_are_past_its_commit():
    from collector.live.receivers.kafka_offsets import KafkaOffsets, decode_metadata, encode_metadata

    x, y = bytes([1]) * 16, bytes([2]) * 16
    metadata, unnamed = encode_metadata([y[:8]], 4096)
    assert unnamed == 0
    offsets = KafkaOffsets(4096)
    offsets.assign(0, 10, metadata)
    assert offsets.skips(0, 10, y) and not offsets.skips(0, 10, x)
    _append(offsets, 0, 10, x)
    offsets.taken(0, 11)             # Y's message at 11, skipped
    assert offsets.skips(0, 11, y)
    point = offsets.commit_point(0)
    assert point.offset == 10 and decode_metadata(point.metadata) == {y[:8]}
    offsets.release([(x, offsets.mark())])
    point = offsets.commit_point(0)
    assert (point.offset, point.metadata) == (12, "")


def test_commit_metadata_over_its_limit_names_what_fits_and_counts_the_rest():
    from collector.live.receivers.kafka_offsets import METADATA_PREFIX, decode_metadata, encode_metadata

    keys = [i.to_bytes(8, "big") for i in range(1000)]
    metadata, unnamed = encode_metadata(keys, 4096)
    assert len(metadata) <= 4096 and unnamed == 1000 - len(decode_metadata(metadata)) > 0
    assert decode_metadata(metadata) == set(keys[:len(decode_metadata(metadata))])
    assert encode_metadata(keys, 0) == ("", 1000)
    assert decode_metadata("someone else's") == set() and decode_metadata(METADATA_PREFIX + "!!") == set()


@pytest.mark.parametrize(("section", "error"), [
    ({"receivers": {"kafka": {"enabled": True}}}, "set journal.enabled: false too"),
    ({"receivers": {"kafka": {"client": {"group.id": "other"}}}, "journal": {"enabled": False}},
     "group.id: set by the receiver itself"),
    ({"receivers": {"kafka": {"brokers": ["kafka"]}}}, "expected host:port"),
    ({"receivers": {"kafka": {"enabled": True}}, "journal": {"enabled": False}, "assembly": {"handover": True}},
     "assembly.handover: leave it unset"),
    ({"receivers": {"kafka": {"topics": ["x"]}}}, "receivers.kafka.topics: unknown key"),
])
def test_a_kafka_config_that_cannot_keep_its_promise_is_refused_by_name(tmp_path, section, error):
    import yaml

    from collector.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(section))
    with pytest.raises(ConfigError, match=error):
        load_config(path)
