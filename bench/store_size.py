"""The run store's size (issue 42): bytes a stored run takes on disk and the store's size after N
runs of the bench workload (bench/workload.py, ~40 spans a run) sent through a running collector,
for each source tree given (e.g. this tree and a worktree of main), in one sitting; and, with
``--sweeper``, what the retention sweeper costs under the throughput bench: end-to-end spans/s with
a size cap that keeps the sweeper deleting all the time, beside the same tree without one (and
the other trees, without one: what compressing the document costs).

    .venv/bin/python bench/store_size.py --code . /tmp/base --runs 3000
    .venv/bin/python bench/store_size.py --code . --sweeper --runs 2000 --rounds 3
    .venv/bin/python bench/store_size.py --delete-cost 10000 1000000   # SQLite and PostgreSQL

``--delete-cost``: what one sweeper batch costs as the store grows: a store of each size (rows made
by SQL, each holding a real bench run's compressed document), then a pass deleting its oldest 2,000
runs; milliseconds per batch (the longest a write or read waits for the sweeper) on both backends
(PostgreSQL: a throwaway server, as the tests start one).

The store is measured after the collector stopped (SIGTERM: the WAL is checkpointed into the file
and removed), so the figure is the file an ops team sees: ``runs.db``, plus a WAL if one is left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # bench/'s own modules, imported below
from workload import Collector, encode, send_streams, trace_spans


def files_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.parent.glob(store.name + "*") if p.suffix != ".journal"
               and p.is_file())


def record_bytes(store: Path) -> dict:
    """What the stored record itself holds, per run: the document column (``doc`` before issue 42,
    ``body`` after) and the page usage SQLite reports (``dbstat`` when compiled in)."""
    con = sqlite3.connect(store)
    try:
        columns = {r[1] for r in con.execute("PRAGMA table_info(runs)")}
        column = "body" if "body" in columns else "doc"
        count, doc = con.execute(f"SELECT COUNT(*), AVG(LENGTH({column})) FROM runs").fetchone()
        page_size, pages, free = (con.execute(f"PRAGMA {p}").fetchone()[0]
                                  for p in ("page_size", "page_count", "freelist_count"))
        return {"runs": count, "document_bytes": doc, "document_column": column,
                "pages": pages, "free_pages": free, "page_size": page_size}
    finally:
        con.close()


def size_after(code: str, bodies: list[bytes], runs: int, pg=None) -> dict:
    """The store after ``runs`` runs: SQLite, or with ``pg`` (a server) a PostgreSQL database of its own."""
    url = pg.database() if pg else None
    collector = Collector(code=None if code == "." else code, store={"url": url} if url else None)
    try:
        send_streams("grpc", collector.grpc, bodies, 1)
        if url:
            import psycopg

            with psycopg.connect(url, autocommit=True) as conn:
                while conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] < runs:
                    time.sleep(0.05)
        else:
            collector.wait_stored(runs)
        collector.proc.send_signal(signal.SIGTERM)
        collector.proc.wait(120)
        if url:
            with psycopg.connect(url, autocommit=True) as conn:
                total, table, toast, indexes = conn.execute(
                    "SELECT pg_total_relation_size('runs'), pg_relation_size('runs'), "
                    "COALESCE(pg_total_relation_size(NULLIF(reltoastrelid, 0)), 0), pg_indexes_size('runs') "
                    "FROM pg_class WHERE relname = 'runs'").fetchone()
            out = {"code": code, "backend": "postgresql", "store_bytes": total, "bytes_per_run": total / runs,
                   "heap_bytes": table, "toast_bytes": toast, "index_bytes": indexes}
        else:
            total = files_bytes(collector.store)
            out = {"code": code, "backend": "sqlite", "store_bytes": total, "bytes_per_run": total / runs,
                   **record_bytes(collector.store)}
    finally:
        collector.stop()
    return out


#: The late window of every collector of the ``--sweeper`` runs: runs written within it are never
#: deleted, so the default (5 min) would keep the sweeper idle for the whole bench.
LATE_WINDOW = 1.0


def scrape(prometheus: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{prometheus}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def throughput(code: str, bodies: list[bytes], runs: int, spans: int, store: dict | None) -> dict:
    """End-to-end spans/s until every run is stored (counted by ``agenteval_runs_total``, which a
    deleting sweeper does not lower), with ``store`` as the collector's extra store settings; how
    many runs the sweeper deleted by then, and the longest batch it logged."""
    collector = Collector({"late_window": LATE_WINDOW}, code=None if code == "." else code, store=store)
    try:
        sent = send_streams("grpc", collector.grpc, bodies, 1)
        while scrape(collector.prometheus, "agenteval_runs_total") < runs:
            time.sleep(0.02)
        finished = time.monotonic()
        deleted = scrape(collector.prometheus, "agenteval_store_runs_deleted_total") if store else 0.0
        swept = [json.loads(line) for line in (collector.dir / "log").read_text().splitlines()
                 if '"store_swept"' in line]
    finally:
        collector.stop()
    return {"code": code, "cap": (store or {}).get("retention", {}).get("max_size"),
            "spans_per_s": spans / (finished - sent.started), "runs_deleted": deleted,
            "longest_batch_ms": max((event["longest_batch_ms"] for event in swept), default=None)}


def delete_cost(backend: str, rows: int, body: bytes, pg=None) -> dict:
    """Fill a store of ``backend`` with ``rows`` runs (one a second, oldest first), then time the
    sweeper's pass over the oldest 2,000 (batches of the default size)."""
    from collector.store import Retention, open_store

    now = time.time()
    insert = ("INSERT INTO runs (run_id, trace_id, subject, status, score, preset, source, revision, incomplete, "
              "checked, unchecked, created_at, updated_at, body, finalized_by, maf_release) ")
    if backend == "sqlite":
        folder = Path(tempfile.mkdtemp(prefix="agenteval-delete-"))
        url = str(folder / "runs.db")
        open_store(url).close()
        con = sqlite3.connect(url)
        with con:
            con.executemany(insert + "VALUES (?, ?, 'bench', 'PASS', 1.0, 'standard', 'live', 1, 0, 6, 0, ?, ?, ?, "
                                     "'b', NULL)",
                            ((f"r{i:09d}", f"{i:032x}", now - rows + i, now - rows + i, body) for i in range(rows)))
        con.close()
    else:
        import psycopg

        url = pg.database()
        open_store(url).close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(insert + "SELECT 'r' || lpad(g::text, 9, '0'), md5(g::text), 'bench', 'PASS', 1.0, "
                         "'standard', 'live', 1, 0, 6, 0, %(now)s - %(rows)s + g, %(now)s - %(rows)s + g, %(body)s, "
                         "'b', NULL "
                         "FROM generate_series(0, %(rows)s - 1) AS g", {"now": now, "rows": rows, "body": body})
            conn.execute("VACUUM ANALYZE runs")
    store = open_store(url)
    try:
        size = store.size_bytes()
        started = time.perf_counter()
        deleted = store.sweep(Retention(max_age=rows - 2000 + 0.5, late_window=0), now=now)
        seconds = time.perf_counter() - started
        batches = -(-deleted // Retention().batch)
        return {"backend": backend, "rows": rows, "store_bytes": size, "deleted": deleted, "batches": batches,
                "ms_per_batch": 1000 * seconds / batches, "longest_batch_ms": 1000 * store.longest_batch}
    finally:
        store.close()
        if backend == "sqlite":
            shutil.rmtree(folder, ignore_errors=True)
        else:
            pg.admin(f"DROP DATABASE {url.rsplit('/', 1)[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", nargs="+", default=["."], help="source trees to compare ('.': the installed one)")
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sweeper", action="store_true",
                        help="measure the sweeper's cost under load instead (a size cap, against none)")
    parser.add_argument("--max-size", type=int, default=2 << 20, help="the cap --sweeper sets (bytes)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--postgres", action="store_true",
                        help="measure a PostgreSQL store too (a throwaway server, as the tests start one)")
    parser.add_argument("--delete-cost", type=int, nargs="+", metavar="ROWS",
                        help="measure a sweeper batch's cost in stores of these sizes instead")
    args = parser.parse_args()
    if args.delete_cost:
        from collector.config import CollectorConfig
        from collector.core.reconcile import reconcile
        from collector.core.serialize import run_to_json
        from collector.formats.decode import decode_bytes
        from collector.live.assembler import Assembler
        from collector.store import pack

        # a real run's document: a workload trace reconciled through the collector's classifier
        cfg = CollectorConfig()
        assembler = Assembler(cfg.assembly, cfg.matcher(), lambda: 0.0)
        assembler.offer(decode_bytes(encode([trace_spans(random.Random(args.seed))])[0], cfg.matcher()).spans)
        assembler.clock = lambda: 1e9
        (finalized,) = assembler.sweep().finalized
        body = pack(run_to_json(reconcile(finalized.run)))
        print(json.dumps({"document_bytes_stored": len(body)}), flush=True)
        pg = postgres_server()
        try:
            for rows in args.delete_cost:
                for backend in ("sqlite", "postgresql"):
                    print(json.dumps(delete_cost(backend, rows, body, pg)), flush=True)
        finally:
            pg.destroy()
        return

    rng = random.Random(args.seed)
    traces = [trace_spans(rng) for _ in range(args.runs)]
    spans = sum(len(t) for t in traces)
    bodies = encode(traces)
    print(json.dumps({"runs": args.runs, "spans": spans, "spans_per_run": spans / args.runs,
                      "otlp_bytes_per_run": sum(map(len, bodies)) / args.runs, "cpus": os.cpu_count()}), flush=True)
    results: dict[str, list[dict]] = {}
    pg = postgres_server() if args.postgres else None
    try:
        measure(args, bodies, spans, results, pg)
    finally:
        if pg:
            pg.destroy()
    key = "spans_per_s" if args.sweeper else "bytes_per_run"
    medians = {name: statistics.median(r[key] for r in rows) for name, rows in results.items()}
    first = next(iter(medians.values()))
    print(json.dumps({"median_" + key: medians, "ratio_to_first": {n: v / first for n, v in medians.items()}}))


def postgres_server():
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from conftest import PostgresServer, _pg_bindir

    return PostgresServer(_pg_bindir())


def measure(args: argparse.Namespace, bodies: list[bytes], spans: int, results: dict[str, list[dict]], pg) -> None:
    for _ in range(args.rounds):
        for code in args.code:
            if args.sweeper:  # the cap on the first tree only (an older one has no store.retention)
                capped = {"retention": {"max_size": args.max_size, "sweep_interval": 0.5}}
                for store in (None, capped) if code == args.code[0] else (None,):
                    row = throughput(code, bodies, args.runs, spans, store)
                    results.setdefault(f"{code} cap={row['cap']}", []).append(row)
                    print(json.dumps(row), flush=True)
            else:
                for server in (None, pg) if pg else (None,):
                    row = size_after(code, bodies, args.runs, server)
                    results.setdefault(f"{code} {row['backend']}", []).append(row)
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
