"""Ring changes under load, the longer rounds (docs/scale-out.md, "Load balancer, honest"): per kind of
scale event, a round of its own with ``--traces`` traces exported as a real SDK does (children first,
the root last, over 4-8 s each) through our OpenTelemetry Collector distribution (``dns`` resolver
over a private hosts file, tests/scale_events.py) to agenteval replicas sharing a real PostgreSQL,
and the event in the middle of the load; plus a control round without one. Per round: of the traces
in flight at the event, how many were stored exactly (one run, the truth), merged exactly (the
same, with parts handed over between replicas), flagged (split or incomplete: honest, not exact),
wrong (a clean-looking run better than the truth), missing (no better, but a unit missing unflagged) or
lost; and published verdicts the store no longer holds. Needs root (unshare -m) and `make otelcol`.

    .venv/bin/python bench/scale_events.py [--traces 300] [--rounds 1] [--spread 40]
    .venv/bin/python bench/scale_events.py --code /tmp/base   # the replicas of a worktree of another commit
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import PostgresServer, _pg_bindir
from scale_events import run_round

KINDS = ["control", "scale up", "scale down + SIGTERM", "kill -9 + restart", "rolling restart"]
COLUMNS = ["exact", "merged", "flagged", "missing", "wrong", "lost"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=300)
    ap.add_argument("--spread", type=float, default=40.0, help="seconds over which the traces start")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per kind of event")
    ap.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    ap.add_argument("--code", help="run the replicas from this source tree (e.g. a worktree of a commit before "
                                   "issue 43, without its settings) instead of the installed one")
    args = ap.parse_args()
    server = PostgresServer(_pg_bindir())
    totals: dict[str, Counter] = {}
    deleted = 0
    try:
        for round_ in range(args.rounds):
            for kind in args.kinds:
                events = [] if kind == "control" else [(args.spread / 2, kind)]
                with tempfile.TemporaryDirectory(prefix="agenteval-scale-") as tmp:
                    got = run_round(Path(tmp), server.database(), args.traces, seed=43_000 + round_,
                                    events=events, replicas=2 if kind != "scale down + SIGTERM" else 3,
                                    spread=args.spread, code=args.code)
                table = got.table()
                row = table.get(kind, table["all traces"])
                totals.setdefault(kind, Counter()).update(row)
                totals.setdefault(f"{kind}: all traces", Counter()).update(table["all traces"])
                deleted += len(got.deleted)
                print(f"round {round_ + 1} {kind}: in flight {sum(row.values())}: {dict(row)}; "
                      f"all {dict(table['all traces'])}; deleted {len(got.deleted)}; acked {got.acked} "
                      f"refused {got.refused}", flush=True)
    finally:
        server.destroy()
    print(f"\n| traces in flight at | {' | '.join(COLUMNS)} | right / in flight |")
    print(f"|---|{'---|' * len(COLUMNS)}---|")
    for kind, counts in totals.items():
        n = sum(counts.values())
        right = counts["exact"] + counts["merged"]
        print(f"| {kind} | {' | '.join(str(counts[c]) for c in COLUMNS)} | {right} / {n} |")
    print(f"published verdicts deleted: {deleted}")


if __name__ == "__main__":
    main()
