"""Offline CLI scaling: `agenteval bench workflow-trace-fidelity` on OTLP JSONL files of growing size.

For each size: wall time and peak RSS of the CLI process, beside the baseline of the same run: a
child process that only reads the file and ``json.loads`` every line. Peak RSS is each child's own
VmHWM, written by the child at exit: ``wait4``'s (and the child's ``getrusage``) maxrss would include
this process's RSS, which a child spawned by vfork + exec inherits as its starting maximum.

    .venv/bin/python bench/offline.py --spans 10000 100000 1000000
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

sys.path.insert(0, str(Path(__file__).parent))
from workload import AGENTEVAL, encode, trace_spans

READ_ONLY = "import json,sys\nfor line in open(sys.argv[1],'rb'):\n    json.loads(line)\n"
#: ``python -c PEAK out script args...``: runs ``script`` as ``__main__`` with ``args`` and, at exit
#: (after ``sys.exit`` too), writes this interpreter's peak RSS in KiB (VmHWM) to ``out``.
PEAK = """import atexit, os, runpy, sys
out = sys.argv.pop(1)
def peak():
    with open('/proc/self/status') as status:
        hwm = next(line for line in status if line.startswith('VmHWM:')).split()[1]
    with open(out, 'w') as fh:
        fh.write(hwm)
atexit.register(peak)
sys.argv.pop(0)
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as if the script had been run directly
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def write_jsonl(path: Path, spans: int, seed: int = 7) -> tuple[int, int]:
    """MAF-shaped traces as the OpenTelemetry Collector's file exporter writes them; (spans, traces)."""
    rng = random.Random(seed)
    written = traces = 0
    with path.open("w") as fh:
        while written < spans:
            batch = []
            while written < spans and sum(len(t) for t in batch) < 5000:
                batch.append(trace_spans(rng))
                written += len(batch[-1])
                traces += 1
            for body in encode(batch, 512):
                doc = json_format.MessageToDict(ExportTraceServiceRequest.FromString(body))
                for rs in doc["resourceSpans"]:
                    for ss in rs["scopeSpans"]:
                        for span in ss["spans"]:  # OTLP/JSON ids are hex, not protobuf JSON's base64
                            for key in ("traceId", "spanId", "parentSpanId"):
                                if key in span:
                                    span[key] = base64.b64decode(span[key]).hex()
                fh.write(json.dumps(doc, separators=(",", ":")) + "\n")
    return written, traces


def measure(script: Path, args: list[str], peak_file: Path) -> tuple[float, float, int]:
    """(seconds, peak RSS MiB, exit code) of ``script args`` run by a fresh interpreter."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PEAK, str(peak_file), str(script), *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.monotonic() - start
    if proc.returncode not in (0, 9, 10, 11):
        raise RuntimeError(f"{script.name} exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    return elapsed, int(peak_file.read_text()) / 1024, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spans", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="agenteval-offline-") as folder:
        tmp = Path(folder)
        read_only = tmp / "read_only.py"
        read_only.write_text(READ_ONLY)
        for n in args.spans:
            path = tmp / f"spans-{n}.jsonl"
            spans, traces = write_jsonl(path, n)
            base_s, base_rss, _ = measure(read_only, [str(path)], tmp / "peak")
            cli_s, cli_rss, code = measure(Path(AGENTEVAL), ["bench", "workflow-trace-fidelity", "--workflow-trace",
                                                             str(path), "--subject", "bench", "--json", "--store",
                                                             str(tmp / f"runs-{n}.db")], tmp / "peak")
            rows.append((spans, traces, path.stat().st_size / 2**20, cli_s, spans / cli_s, base_s, cli_s / base_s,
                         cli_rss, base_rss, code))
            path.unlink()
    print("| spans | traces | file MiB | CLI s | CLI spans/s | read+json.loads s | ratio | CLI peak RSS MiB | "
          "baseline peak RSS MiB | exit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]:,} | {r[1]:,} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:,.0f} | {r[5]:.1f} | {r[6]:.1f}x | "
              f"{r[7]:.1f} | {r[8]:.1f} | {r[9]} |")


if __name__ == "__main__":
    main()
