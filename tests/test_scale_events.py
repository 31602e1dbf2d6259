"""Replicas come and go behind the load balancer, for real (docs/scale-out.md, "Load balancer,
honest"): our OpenTelemetry Collector distribution with the ``dns`` resolver over a private hosts
file, 2-3 agenteval replicas on one PostgreSQL, traces exported as a real SDK does over several
seconds, and mid-load a scale up, a scale down with SIGTERM at the same moment as the removal, a
kill -9 of one replica (restarted on its journal) and a rolling restart of every replica. No trace
is silently wrong: none lost, no clean-looking run better than the truth or missing a unit, no
published verdict deleted; and traces split by the ring changes are merged exactly. The longer
rounds are bench/scale_events.py's."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from scale_events import run_round
from test_scaleout import otelcol_built  # a fixture


@pytest.fixture
def unshare() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): the load balancer gets its own /etc/hosts in a mount namespace")


def test_no_trace_is_silently_wrong_through_every_kind_of_scale_event(otelcol_built, unshare, postgres,
                                                                       tmp_path):
    got = run_round(tmp_path, postgres.database(), traces=160, seed=4343, spread=36.0,
                    events=[(5.0, "scale up"), (13.0, "scale down + SIGTERM"), (21.0, "kill -9 + restart"),
                            (28.0, "rolling restart")])
    table = {event: dict(counts) for event, counts in got.table().items()}
    print(table)
    wrong = {t: v for t, v in got.outcome.items() if v.startswith(("wrong", "missing", "lost"))}
    assert not wrong, f"{len(wrong)} traces silently wrong, missing a unit or lost: {list(wrong.items())[:5]}; {table}"
    assert not got.deleted, f"published verdicts deleted: {got.deleted[:5]}"
    assert got.refused == 0
    for event, traces in got.in_flight.items():
        assert traces, f"no trace in flight at {event}: the round is too short"
    # the ring changes did split traces, and the hand-over merged them into one exact run
    assert table["all traces"].get("merged", 0) > 0, table


def test_a_stopping_collector_keeps_accepting_for_its_shutdown_delay(tmp_path):
    """SIGTERM with shutdown_delay: readiness says it is stopping, spans a load balancer still routes
    here are accepted (not refused, to be dropped once the replica leaves the ring), and their run
    is stored before it exits."""
    import signal
    import urllib.error
    import urllib.request

    from conftest import CollectorProcess, post
    from mafshape import SCENARIOS, export_request, record, run_id

    proc = CollectorProcess(tmp_path, {"shutdown_delay": 3.0})
    spans, (trace,) = record([SCENARIOS["pass"][0]])
    proc.proc.send_signal(signal.SIGTERM)
    while not any(e.get("event") == "collector_stopping" for e in proc.log_events()):
        time.sleep(0.05)
    try:
        urllib.request.urlopen(f"{proc.http}/readyz", timeout=5)
        raise AssertionError("ready while stopping")
    except urllib.error.HTTPError as exc:
        assert exc.code == 503 and "stopping" in json.loads(exc.read())["reason"]
    status, _, _ = post(proc.http, export_request(spans).SerializeToString())
    assert status == 200
    assert proc.stop() == 0
    assert proc.store().get_run(run_id(trace))["status"] == "PASS"
