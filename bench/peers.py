"""Our collector beside rotel (a Rust OTLP collector, blackhole exporter) on the same pre-encoded
MAF-shaped payload over gRPC, 1 and 16 concurrent streams, alternating, in one run; with
``--payload plain``, a payload in which no agent runs (HTTP server, database, HTTP client and message
spans: what a tee'd production feed mostly holds), whose traces ours finalizes without a run.

rotel comes from its PyPI wheel (``.venv/bin/pip install rotel``). Its Python package starts the
bundled ``rotel-agent`` binary as ``rotel-agent start --daemon`` with ``ROTEL_*`` settings in the
environment; here the same binary runs in the foreground (``start --exporter blackhole``) so its
pid is ours to measure. It cannot bind port 0 (it panics), so its ports are picked free beforehand.

Per run and server: spans/s, CPU-seconds per 100K spans (utime + stime of the server process from
``/proc/<pid>/stat``, every thread and any waited-for children), RSS idle (before the load),
steady (median of samples taken every 20 ms from the first request to the last answer; for ours,
to the last verdict stored) and peak (VmHWM). For ours, "accepted" = every request answered and
"end to end" = every run's verdict stored; its CPU counts until stored. rotel's CPU is read 0.5 s
after the last answer (past its 200 ms batch timeout), when the blackhole has taken every batch.
The sender's own CPU while sending is shown too: on a 2-core box it competes with the server.
Each run starts fresh servers; their order alternates from run to run. With ``--code`` the
collector of each source tree given runs beside rotel (as bench/throughput.py's ``--code``: a tree's
own ``.venv`` when it has one), and each is compared with the last. ``--unpriced`` also runs the first
tree's collector with ``pricing.enabled: false``, beside the same tree priced: what pricing every
chat call costs a span (the bench's model is one genai-prices knows).

    .venv/bin/python bench/peers.py [--traces 3000] [--streams 1 16] [--runs 3]
    .venv/bin/python bench/peers.py --code . /tmp/base --runs 3   # this tree and another commit's, beside rotel
    .venv/bin/python bench/peers.py --code . /tmp/base --unpriced  # and this tree with pricing off
    .venv/bin/python bench/peers.py --payload plain  # spans no agent is in ("end to end": all finalized)
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workload import (
    Collector,
    RssSampler,
    cpu_seconds,
    encode,
    free_ports,
    plain_trace_spans,
    rss_kib,
    send_streams,
    trace_spans,
)

#: rotel batches for at most this long (``--batch-timeout``, default 200 ms) before its exporter runs.
ROTEL_SETTLE = 0.5


class Rotel:
    """``rotel-agent`` in the foreground with the blackhole exporter, on free local ports; stopped and
    its temp folder removed on leaving the ``with`` block."""

    def __init__(self) -> None:
        from rotel.agent import agent as rotel_agent

        self.dir = Path(tempfile.mkdtemp(prefix="rotel-bench-"))
        grpc_port, http_port = free_ports(2)
        self.grpc = f"127.0.0.1:{grpc_port}"
        self.log = (self.dir / "log").open("w+")
        self.proc = subprocess.Popen(
            [str(rotel_agent.agent_path), "start", "--exporter", "blackhole",
             "--otlp-grpc-endpoint", self.grpc, "--otlp-http-endpoint", f"127.0.0.1:{http_port}",
             "--otlp-grpc-max-recv-msg-size-mib", "64",
             "--pid-file", str(self.dir / "pid"), "--log-file", str(self.dir / "log-file")],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", grpc_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        tail = (self.dir / "log").read_text()[-2000:]
        self.stop()
        raise RuntimeError(f"rotel did not start (exit code {self.proc.returncode}): {tail}")

    def __enter__(self) -> Rotel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def measure(peer: str, streams: int, bodies: list[bytes], traces: int, spans: int, code: str | None = None,
            unpriced: bool = False, plain: bool = False) -> dict:
    """One run against a fresh server (ours: the collector of source tree ``code``, None: the installed
    one; ``unpriced``: with pricing off). ``plain``: the payload holds no run, so ours is done when
    every trace was finalized without one."""
    with (Collector(code=code, pricing={"enabled": False} if unpriced else None) if peer == "ours"
          else Rotel()) as server:
        pid = server.proc.pid
        idle = rss_kib(pid)[0]
        cpu0 = cpu_seconds(pid)
        with RssSampler(pid) as sampler:
            sent = send_streams("grpc", server.grpc, bodies, streams)
            done = (server.wait_ignored if plain else server.wait_stored) if isinstance(server, Collector) else None
            e2e = spans / (done(traces) - sent.started) if done is not None else None
        if peer == "rotel":
            time.sleep(ROTEL_SETTLE)  # its last batch reaches the blackhole
        cpu = cpu_seconds(pid) - cpu0
        peak = rss_kib(pid)[1]
    name = peer if peer == "rotel" or code is None else f"ours {code}"
    return {"peer": f"{name} (pricing off)" if unpriced else name, "streams": streams,
            "accepted": spans / sent.seconds, "e2e": e2e,
            "cpu_per_100k": cpu / spans * 1e5, "sender_cpu_per_100k": sent.cpu / spans * 1e5,
            "idle_mib": idle / 1024, "steady_mib": sampler.steady_kib / 1024, "peak_mib": peak / 1024,
            "refused": sent.refused}


def row(r: dict) -> str:
    e2e = f"{r['e2e']:,.0f}" if r["e2e"] is not None else "-"
    return (f"| {r['peer']} | {r['streams']} | {r['accepted']:,.0f} | {e2e} | {r['cpu_per_100k']:.2f} | "
            f"{r['sender_cpu_per_100k']:.2f} | {r['idle_mib']:.1f} | {r['steady_mib']:.1f} | {r['peak_mib']:.1f} | "
            f"{r['refused']} |")


#: Per-run figures whose median over runs is reported.
FIGURES = ("accepted", "e2e", "cpu_per_100k", "sender_cpu_per_100k", "idle_mib", "steady_mib", "peak_mib", "refused")
HEADER = ("| server | streams | accepted spans/s | end-to-end spans/s | CPU s /100K spans | sender CPU s /100K | "
          "idle RSS MiB | steady RSS MiB | peak RSS MiB | refused |\n|---|---|---|---|---|---|---|---|---|---|")


def comparisons(ours: list[str], unpriced: bool) -> list[tuple[str, str]]:
    """The pairs of our collectors compared (name, base): each tree beside the last and, with
    ``unpriced``, the first tree priced beside itself unpriced (``ours[1]``); none for one tree alone."""
    pairs = [(name, ours[-1]) for name in ours[:-1]] + ([(ours[0], ours[1])] if unpriced else [])
    return list(dict.fromkeys(pairs))


def main() -> None:
    from rotel.agent import agent as rotel_agent

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=3000)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--spans-per-request", type=int, default=512)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--code", nargs="+", default=[None],
                    help="source trees whose collector to run (default: the installed one), side by side")
    ap.add_argument("--unpriced", action="store_true",
                    help="also the first tree's collector with pricing.enabled: false")
    ap.add_argument("--payload", choices=["maf", "plain"], default="maf",
                    help="maf: MAF workflow traces (every chat call priced); plain: spans no agent is in")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    make = plain_trace_spans if args.payload == "plain" else trace_spans
    payload = [make(rng) for _ in range(args.traces)]
    spans = sum(len(t) for t in payload)
    bodies = encode(payload, args.spans_per_request)
    print(f"{args.payload} payload: {args.traces:,} traces, {spans:,} spans in {len(bodies)} requests; "
          f"rotel {rotel_agent.agent_path}")
    print(HEADER)
    servers = ([("ours", args.code[0], False)] + [("ours", args.code[0], True)] * args.unpriced
               + [("ours", code, False) for code in args.code[1:]] + [("rotel", None, False)])
    results: dict[tuple[str, int], list[dict]] = {}
    for run in range(args.runs):
        for streams in args.streams:
            for peer, code, unpriced in servers if run % 2 == 0 else servers[::-1]:
                r = measure(peer, streams, bodies, args.traces, spans, code, unpriced, args.payload == "plain")
                results.setdefault((r["peer"], streams), []).append(r)
                print(row(r), flush=True)
    names = list(dict.fromkeys(name for name, _ in results))
    ours = [name for name in names if name != "rotel"]
    print(f"\nMedians of {args.runs} runs:\n")
    print(HEADER)
    for streams in args.streams:
        for name in names:
            rs = results[(name, streams)]
            print(row({**rs[0], **{k: statistics.median(r[k] for r in rs) for k in FIGURES if rs[0][k] is not None}}))
    print()
    for streams in args.streams:
        for name in ours:
            pairs = list(zip(results[(name, streams)], results[("rotel", streams)], strict=True))
            cpu = statistics.median(o["cpu_per_100k"] / r["cpu_per_100k"] for o, r in pairs)
            accepted = statistics.median(o["accepted"] / r["accepted"] for o, r in pairs)
            e2e = statistics.median(o["e2e"] / r["accepted"] for o, r in pairs)
            print(f"{streams} stream{'s' * (streams > 1)}: {name}/rotel CPU per span {cpu:.2f}x; "
                  f"throughput {name}/rotel accepted {accepted:.3f}, end-to-end {e2e:.3f} "
                  f"(medians of {len(pairs)} pairs)")
        for name, base in comparisons(ours, args.unpriced):
            pairs = list(zip(results[(name, streams)], results[(base, streams)], strict=True))
            cpu = statistics.median(o["cpu_per_100k"] / b["cpu_per_100k"] for o, b in pairs)
            e2e = statistics.median(o["e2e"] / b["e2e"] for o, b in pairs)
            print(f"{streams} stream{'s' * (streams > 1)}: {name} / {base}: CPU per span {cpu:.2f}x, "
                  f"end-to-end spans/s {e2e:.2f}x (medians of {len(pairs)} pairs)")
    for name in names:
        lo, hi = min(args.streams), max(args.streams)
        ratio = (statistics.median(r["accepted"] for r in results[(name, hi)])
                 / statistics.median(r["accepted"] for r in results[(name, lo)]))
        print(f"{name}: accepted spans/s with {hi} streams / {lo} = {ratio:.2f}")


if __name__ == "__main__":
    main()
