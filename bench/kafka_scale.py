"""The Kafka topology through every kind of scale event, and its steady-state cost (docs/scale-out.md).

Part 1, exactness: a real Kafka broker (`make kafka`), our otelcol distribution on
config/otelcol-kafka.yaml, agenteval replicas in one consumer group sharing a throwaway PostgreSQL.
``--traces`` MAF-shaped traces (tests/mafshape.py: known verdicts) are exported by the OTLP SDK over
``--duration`` seconds, each trace's spans over 3-6 s, root last. Mid-load: a scale up (a replica
joins), a scale down (SIGTERM), a kill -9 (and restart), a rolling restart of every replica (SIGTERM,
start again, one after the other). Per event: the traces in flight at it (spans sent, root not
yet) and how many of those were stored exactly right (one run, complete, the status and unit
verdicts one replica alone gives it).

Part 2, steady-state cost: one replica, the same payload (bench/workload.py's traces) delivered
through its OTLP/gRPC receiver (journal on, as deployed today; and off) and through the kafka
receiver (journal off; messages one trace each, as the kafka exporter writes them with
partition_traces_by_id, produced by the bench while the replica consumes). Per variant: the
replica's CPU-seconds per 100K spans and spans/s from the first span sent to the last run stored;
variants alternate for ``--rounds`` rounds, the median round is reported.

    .venv/bin/python bench/kafka_scale.py [--traces 600] [--duration 60] [--cost-traces 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from otelcol.process import Otelcol, binary_path

from conftest import PostgresServer, _pg_bindir
from kafka import KafkaBroker, libs_path
from mafshape import SCENARIOS, run_id
from test_kafka import CONFIG, PacedLoad, group, make_traffic, stored_runs, unit_verdicts
from workload import Collector, encode, send_streams, trace_spans


def exactness(args: argparse.Namespace, broker: KafkaBroker, postgres: PostgresServer, tmp: Path) -> None:
    url = postgres.database()
    topic = f"bench_{int(time.time())}"
    broker.create_topic(topic, args.partitions)
    names = [f"agenteval-{i}" for i in range(1, 5)]
    replicas = group(tmp, url, broker, topic, names)
    first, second, third, joiner = replicas
    for replica in (first, second, third):
        replica.start()
    for replica in (first, second, third):
        replica.wait_for("kafka_partitions_assigned")
    otelcol = Otelcol([CONFIG], tmp / "otelcol.log", {"KAFKA_BROKERS": f"[{broker.bootstrap}]", "KAFKA_TOPIC": topic,
                                                      "OTELCOL_RETRY_INITIAL_INTERVAL": "100ms",
                                                      "OTELCOL_RETRY_MAX_INTERVAL": "500ms"})
    traffic = make_traffic(args.traces)
    d = args.duration
    events: list[tuple[str, float]] = []
    try:
        load = PacedLoad(otelcol.grpc, traffic, duration=d, spread=(3.0, 6.0))
        events.append(("scale up (a 4th replica joins)", load.wait_until(0.15 * d)))
        joiner.start()
        events.append(("scale down (SIGTERM)", load.wait_until(0.3 * d)))
        second.current.stop()
        events.append(("kill -9 (and restart)", load.wait_until(0.45 * d)))
        third.kill_9()
        third.start()
        # each replica back (listening) before the next one stops, as a Deployment's rollout waits for
        # readiness: the later steps come later than planned when a start is slow
        for i, replica in enumerate((first, third, joiner)):
            events.append((f"rolling restart {i + 1}/3 (SIGTERM, start)", load.wait_until((0.6 + 0.1 * i) * d)))
            replica.current.stop()
            replica.start()
        load.finish()
        deadline = time.monotonic() + 180
        while set(traffic.spans) - set(stored_runs(url)) and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(5)  # anything published twice would be stored by now
        runs, units = stored_runs(url), unit_verdicts(url)
    finally:
        otelcol.stop()
        for replica in replicas:
            if replica.lives:
                replica.current.stop()

    def right(tid: str) -> bool:
        _, status, verdicts = SCENARIOS[traffic.scenario[tid]]
        got = runs.get(tid, [])
        return ([(r["run_id"], r["incomplete"], r["status"]) for r in got] == [(run_id(tid), False, status)]
                and units.get(tid) == verdicts)

    print(f"\n## Exactness: {args.traces} traces over {d:g} s, each exported over 3-6 s (root last), "
          f"{args.partitions} partitions\n")
    print("| event | at s | traces in flight | stored exactly right |")
    print("|---|---|---|---|")
    for name, at in events:
        flight = load.in_flight(at)
        print(f"| {name} | {at:.1f} | {len(flight)} | {sum(right(t) for t in flight)} |")
    total = sum(right(t) for t in traffic.spans)
    print(f"| all traces | | {len(traffic.spans)} | {total} |")
    dropped = sum(e["dropped_open_traces"] for r in replicas
                  for e in r.events("kafka_partitions_revoked") + r.events("kafka_receiver_stopped"))
    print(f"\nopen traces dropped for their next owner at the changes: {dropped}; "
          f"runs published (run_verdict lines, all replicas): {sum(len(r.events('run_verdict')) for r in replicas)}")


def cost(args: argparse.Namespace, broker: KafkaBroker) -> None:
    from confluent_kafka import Producer

    rng = random.Random(7)
    payload = [trace_spans(rng) for _ in range(args.cost_traces)]
    n_spans = sum(len(t) for t in payload)
    bodies = encode(payload, 512)
    messages = [(t[0].trace_id, encode([t], 10**9)[0]) for t in payload]

    def otlp(journal: bool) -> dict:
        with Collector(journal=journal) as replica:
            before = replica.cpu_seconds()
            sent = send_streams("grpc", replica.grpc, bodies, 1)
            end = replica.wait_stored(args.cost_traces)
            return {"cpu": replica.cpu_seconds() - before, "seconds": end - sent.started}

    def kafka() -> dict:
        topic = f"cost_{time.monotonic_ns()}"
        broker.create_topic(topic, args.partitions)
        receivers = {"grpc": {"enabled": False}, "http": {"endpoint": "127.0.0.1:0"},
                     "kafka": {"enabled": True, "brokers": [broker.bootstrap], "topic": topic, "group_id": topic}}
        with Collector(journal=False, receivers=receivers) as replica:
            while '"kafka_partitions_assigned"' not in (replica.dir / "log").read_text():
                time.sleep(0.05)
            before = replica.cpu_seconds()
            started = time.monotonic()
            producer = Producer({**broker.client(), "linger.ms": 5})
            for key, value in messages:
                producer.produce(topic, value, key=key)
                producer.poll(0)
            producer.flush(60)
            end = replica.wait_stored(args.cost_traces)
            return {"cpu": replica.cpu_seconds() - before, "seconds": end - started}

    variants = {"OTLP/gRPC receiver, journal on (today)": lambda: otlp(True),
                "OTLP/gRPC receiver, journal off": lambda: otlp(False),
                "kafka receiver (journal off)": kafka}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, variant in variants.items():
            results[name].append(variant())
    print(f"\n## Steady-state cost: {args.cost_traces} traces, {n_spans} spans, one replica, "
          f"{args.rounds} rounds (median)\n")
    print("| variant | replica CPU-s / 100K spans | vs today | spans/s e2e | rounds (CPU-s / 100K) |")
    print("|---|---|---|---|---|")
    base = None
    for name, rs in results.items():
        r = sorted(rs, key=lambda x: x["cpu"])[len(rs) // 2]
        per = r["cpu"] / n_spans * 1e5
        base = base or per
        rounds = ", ".join(f"{x['cpu'] / n_spans * 1e5:.2f}" for x in rs)
        print(f"| {name} | {per:.2f} | {per / base:.2f}x | {n_spans / r['seconds']:.0f} | {rounds} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=600)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--partitions", type=int, default=12)
    ap.add_argument("--cost-traces", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    args = ap.parse_args()
    if not binary_path().exists():
        sys.exit(f"our OpenTelemetry Collector distribution is not built ({binary_path()}): run `make otelcol`")
    if not (libs_path() / ".complete").exists():
        sys.exit("the Kafka broker is not resolved: run `make kafka`")
    bindir = _pg_bindir()
    if bindir is None:
        sys.exit("PostgreSQL is not installed (apt-get install postgresql)")
    broker = KafkaBroker(libs_path())
    postgres = PostgresServer(bindir)
    try:
        with tempfile.TemporaryDirectory(prefix="agenteval-kafka-bench-") as tmp:
            if not args.skip_exactness:
                exactness(args, broker, postgres, Path(tmp))
            if not args.skip_cost:
                cost(args, broker)
    finally:
        postgres.destroy()
        broker.destroy()


if __name__ == "__main__":
    main()
