"""Scale-out on this box (docs/design.md §7): one agenteval replica alone, against our OpenTelemetry Collector
distribution (otelcol/manifest.yaml, `make otelcol`) on config/otelcol.yaml routing by trace id to 1
and to 2 replicas; beside them the same binary as a plain peer pipeline (otlp -> groupbytrace -> nop)
on the same payload. Each variant starts fresh processes; the variants alternate for ``--rounds``
rounds and the median round is reported.

Per variant: end-to-end spans/s (first request sent until every run's verdict is stored; for the
peer, until groupbytrace has released every span to nop), CPU-seconds per 100K spans of the server
processes (utime + stime from /proc, the load balancer and the replicas together, and the load
balancer's own part), RSS steady (median of samples every 20 ms under load) and peak (VmHWM), summed
over the server processes. Replicas are bench/workload.py's collector (quiet period 0.2 s, its own
SQLite store, journal on); the peer's groupbytrace waits the same 0.2 s. The load balancer runs
without Jaeger: its second pipeline ends in nop.

    .venv/bin/python bench/scaleout.py [--traces 2000] [--rounds 3] [--streams 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from otelcol.process import Otelcol, binary_path

from workload import Collector, RssSampler, cpu_seconds, encode, rss_kib, send_streams, trace_spans

CONFIG = ROOT / "config/otelcol.yaml"
#: The deployed config without Jaeger (none here): its pipeline's exporter becomes nop.
NO_JAEGER = ["yaml:exporters::nop: {}", "yaml:service::pipelines::traces/jaeger::exporters: [nop]"]
#: The peer: the collector's own per-trace grouping, then nothing.
PEER = {
    "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "${env:OTELCOL_GRPC_ENDPOINT}",
                                                  "max_recv_msg_size_mib": 64},
                                         "http": {"endpoint": "${env:OTELCOL_HTTP_ENDPOINT}"}}}},
    "processors": {"groupbytrace": {"wait_duration": "200ms", "num_workers": 2}},
    "exporters": {"nop": {}},
    "service": {"pipelines": {"traces": {"receivers": ["otlp"], "processors": ["groupbytrace"], "exporters": ["nop"]}},
                "telemetry": {"metrics": {"readers": [{"pull": {"exporter": {"prometheus": {
                    "host": "${env:OTELCOL_METRICS_HOST}", "port": "${env:OTELCOL_METRICS_PORT}"}}}}]}}},
}
def measure(pids: list[int], otelcol_pid: int | None, target: str, bodies: list[bytes], streams: int,
            done: Callable[[], bool]) -> dict:
    """Send ``bodies`` to ``target`` and wait until ``done()``; the servers' CPU and RSS meanwhile."""
    before = {pid: cpu_seconds(pid) for pid in pids}
    with ExitStack() as stack:
        samplers = [stack.enter_context(RssSampler(pid)) for pid in pids]
        sent = send_streams("grpc", target, bodies, streams)
        while not done():
            time.sleep(0.02)
        finished = time.monotonic()
    cpu = {pid: cpu_seconds(pid) - before[pid] for pid in pids}
    return {"seconds": finished - sent.started, "accepted_seconds": sent.seconds, "refused": sent.refused,
            "cpu": sum(cpu.values()), "otelcol_cpu": cpu[otelcol_pid] if otelcol_pid else 0.0,
            "steady_mib": sum(s.steady_kib for s in samplers) / 1024,
            "peak_mib": sum(rss_kib(pid)[1] for pid in pids) / 1024}


def alone(bodies: list[bytes], traces: int, n_spans: int, streams: int, tmp: Path) -> dict:
    with Collector() as replica:
        return measure([replica.proc.pid], None, replica.grpc, bodies, streams, lambda: replica.stored() >= traces)


def balanced(replicas: int) -> Callable[[list[bytes], int, int, int, Path], dict]:
    """The deployed load balancer in front of ``replicas`` replicas."""

    def run(bodies: list[bytes], traces: int, n_spans: int, streams: int, tmp: Path) -> dict:
        with ExitStack() as stack:
            collectors = [stack.enter_context(Collector()) for _ in range(replicas)]
            lb = Otelcol([CONFIG, *NO_JAEGER], tmp / "lb.log",
                         {"AGENTEVAL_REPLICAS": "[" + ", ".join(c.grpc for c in collectors) + "]"})
            stack.callback(lb.stop)
            result = measure([lb.proc.pid, *(c.proc.pid for c in collectors)], lb.proc.pid, lb.grpc, bodies,
                             streams, lambda: sum(c.stored() for c in collectors) >= traces)
            return {**result, "shares": [c.stored() for c in collectors]}

    return run


def peer(bodies: list[bytes], traces: int, n_spans: int, streams: int, tmp: Path) -> dict:
    config = tmp / "peer.yaml"
    config.write_text(yaml.safe_dump(PEER))
    collector = Otelcol([config], tmp / "peer.log", {})
    try:
        def released() -> bool:
            return sum(v for k, v in collector.metrics().items()
                       if k.startswith("otelcol_processor_groupbytrace_spans_released")) >= n_spans

        return measure([collector.proc.pid], None, collector.grpc, bodies, streams, released)
    finally:
        collector.stop()


VARIANTS: dict[str, Callable[[list[bytes], int, int, int, Path], dict]] = {
    "agenteval alone": alone,
    "otelcol LB + 1 replica": balanced(1),
    "otelcol LB + 2 replicas": balanced(2),
    "otelcol peer (groupbytrace -> nop)": peer,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=1, help="concurrent client connections")
    ap.add_argument("--spans-per-request", type=int, default=512)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if not binary_path().exists():
        sys.exit(f"our OpenTelemetry Collector distribution is not built ({binary_path()}): run `make otelcol`")
    rng = random.Random(args.seed)
    payload = [trace_spans(rng) for _ in range(args.traces)]
    n_spans = sum(len(t) for t in payload)
    bodies = encode(payload, args.spans_per_request)
    print(f"{args.traces} traces, {n_spans} spans in {len(bodies)} requests, {args.streams} stream(s), "
          f"{args.rounds} round(s); median round:")
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="agenteval-scaleout-bench-") as tmp:
        for _ in range(args.rounds):
            for name, variant in VARIANTS.items():
                results[name].append(variant(bodies, args.traces, n_spans, args.streams, Path(tmp)))
    print(f"{'variant':36} {'e2e spans/s':>11} {'vs alone':>8} {'accepted/s':>10} {'CPU-s/100K':>10} "
          f"{'of it LB':>8} {'RSS MiB':>8} {'peak MiB':>8} {'refused':>7}  rounds (spans/s); runs per replica")
    alone_rate = 0.0
    for name, rs in results.items():
        r = sorted(rs, key=lambda x: x["seconds"])[len(rs) // 2]
        rate = n_spans / r["seconds"]
        alone_rate = alone_rate or rate
        rounds = ", ".join(f"{n_spans / x['seconds']:.0f}" for x in rs)
        print(f"{name:36} {rate:11.0f} {rate / alone_rate:8.2f} {n_spans / r['accepted_seconds']:10.0f} "
              f"{r['cpu'] / n_spans * 1e5:10.2f} {r['otelcol_cpu'] / n_spans * 1e5:8.2f} {r['steady_mib']:8.1f} "
              f"{r['peak_mib']:8.1f} {r['refused']:7d}  {rounds}; {r.get('shares', '')}")


if __name__ == "__main__":
    main()
