"""The benchmark scripts in bench/ as their docstrings show them being run."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[1] / "bench"


def _bench(name: str) -> ModuleType:
    """A bench/ script imported as a module (they import bench/workload.py beside them)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def test_peers_on_one_tree_compares_it_with_rotel_alone():
    """`bench/peers.py` with one tree and no `--unpriced` (its docstring's first line) printed its
    table, then built the unpriced pair anyway: IndexError. Importing it needs no rotel either."""
    peers = _bench("peers")
    assert peers.comparisons(["ours"], unpriced=False) == []
    assert peers.comparisons(["ours .", "ours /tmp/base"], unpriced=False) == [("ours .", "ours /tmp/base")]
    assert peers.comparisons(["ours .", "ours . (pricing off)"], unpriced=True) == [("ours .", "ours . (pricing off)")]
    assert peers.comparisons(["ours .", "ours . (pricing off)", "ours /tmp/base"], unpriced=True) == [
        ("ours .", "ours /tmp/base"), ("ours . (pricing off)", "ours /tmp/base"), ("ours .", "ours . (pricing off)")]


def test_the_plain_payload_holds_no_run_and_the_collector_counts_each_trace_ignored():
    """`bench/peers.py --payload plain` (issue 66's non-agent payload) times ours until every trace was
    finalized without a run: that must happen, trace for trace, or the bench would time nothing."""
    import random

    workload = _bench("workload")
    rng = random.Random(3)
    traces = [workload.plain_trace_spans(rng) for _ in range(20)]
    assert all(len(t) >= 6 for t in traces)
    with workload.Collector() as collector:
        sent = workload.send_streams("grpc", collector.grpc, workload.encode(traces, 64), 1)
        assert sent.refused == 0
        collector.wait_ignored(len(traces), timeout=60)
        assert collector.ignored() == len(traces) and collector.stored() == 0
