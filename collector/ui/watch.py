"""``agenteval watch``: follow ``WatchVerdicts`` and show runs as their verdicts arrive.

On a terminal it is a live table (newest first); piped, it prints one line (or one JSON document
with ``--json``) per verdict, so ``agenteval watch | grep FAIL`` works. Losing the collector is not
an error: the client reconnects with capped exponential backoff, replaying recent runs each time.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.core.model import Verdict, fmt_score
from collector.core.spend import known_spend
from collector.outputs.wire import status_number, to_doc
from collector.ui.render import STATUS_STYLE, VERDICT_STYLE, distinct_prefixes, run_unreported, shown

#: Errors that retrying cannot fix: the watcher exits 1 with the server's message.
FATAL_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED}


class WatchFatal(Exception):
    pass


@dataclass(frozen=True)
class WatchTarget:
    endpoint: str
    subject: str | None = None
    statuses: tuple[str, ...] = ()
    token: str | None = None
    ca_file: str | None = None

    def request(self, replay: int) -> pb.WatchRequest:
        return pb.WatchRequest(subject=self.subject, statuses=[status_number(s) for s in self.statuses],
                               replay=replay)

    def channel(self) -> grpc.Channel:
        if self.ca_file is None:
            return grpc.insecure_channel(self.endpoint)
        with open(self.ca_file, "rb") as fh:
            return grpc.secure_channel(self.endpoint, grpc.ssl_channel_credentials(fh.read()))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def no_truth_summary(doc: dict[str, Any]) -> str:
    reasons = Counter(e["no_truth_reason"] for e in doc["executors"] if e["no_truth_reason"])
    return ", ".join(f"{n}x {reason}" if n > 1 else reason for reason, n in sorted(reasons.items()))


def diverged_units(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(unit, verdict) of each checked unit whose accounting diverged."""
    return [(shown(e["executor_id"]), e["verdict"]) for e in doc["executors"]
            if e["verdict"] not in (Verdict.AGREE, Verdict.NO_TRUTH)]


def subject_cell(doc: dict[str, Any]) -> str:
    """The subject, and beneath it the MAF release its spans named (``dotnet-1.28.0``: which runtime)."""
    subject = shown(doc["subject"] or "-")
    return f"{subject}\n[dim]{shown(doc['maf_release'])}[/]" if doc.get("maf_release") else subject


def run_line(doc: dict[str, Any]) -> str:
    """The piped form of one verdict: fixed fields first, so it greps and cuts well."""
    stamp = time.strftime("%H:%M:%S", time.localtime(doc["updated_at"])) if doc.get("updated_at") else "-"
    total = doc["checked"] + doc["unchecked"]
    parts = [stamp, f"{doc['status']:<7}", f"score={fmt_score(doc['score'])}",
             f"checked={doc['checked']}/{total}", f"rev={doc['revision']}", f"run={doc['run_id']}",
             f"subject={shown(doc['subject'] or '-')}"]
    if doc.get("maf_release"):
        parts.append(f"maf={shown(doc['maf_release'])}")  # dotnet-1.28.0 for MAF .NET: says which runtime
    if (spend := known_spend(doc)) is not None:  # a figure no unit has is unknown, never 0
        usd, tokens = spend["unreported_usd"], spend["unreported_tokens"]
        parts.append("unreported_usd=unknown" if usd is None else f"unreported_usd={usd:.6f}")
        parts.append(f"unreported_tokens={'unknown' if tokens is None else tokens}")
        if spend["units_unknown"]:
            parts.append(f"cost_unknown_units={spend['units_unknown']}")
    if diverged := diverged_units(doc):
        parts.append("diverged=" + ",".join(f"{unit}:{verdict}" for unit, verdict in diverged).replace(" ", "_"))
    if reasons := no_truth_summary(doc):
        parts.append(f"no_truth={reasons.replace(' ', '')}")
    if doc.get("incomplete"):
        parts.append("incomplete")
    if doc.get("workflow_errors"):
        parts.append(f"workflow_errors={len(doc['workflow_errors'])}")
    return "  ".join(parts)


@dataclass
class Board:
    """The newest ``rows`` runs, one row per run (a revision replaces its row)."""

    rows: int = 20
    runs: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    state: str = "connecting"

    def add(self, doc: dict[str, Any]) -> None:
        self.runs.pop(doc["run_id"], None)
        self.runs[doc["run_id"]] = doc
        while len(self.runs) > self.rows:
            self.runs.popitem(last=False)

    def render(self, width: int = 120) -> Group:
        """The table; below 100 columns the revision goes and long fields fold instead of being cut."""
        narrow = width < 100
        table = Table(title="agenteval watch: run verdicts, newest first", title_justify="left", expand=True,
                      box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD)
        fixed = {"no_wrap": True, "overflow": "ignore"}
        table.add_column("time", **fixed)
        table.add_column("status", **fixed)
        table.add_column("score", justify="right", **fixed)
        table.add_column("checked", justify="right", **fixed)
        table.add_column("subject", overflow="fold", ratio=2)
        table.add_column("run", overflow="fold", ratio=2)
        if not narrow:  # below 100 columns the revision and the unreported spend go (piped lines keep both)
            table.add_column("rev", justify="right", **fixed)
            table.add_column("unreported", justify="right", overflow="fold")
        table.add_column("diverged / NoTruth reasons", overflow="fold", ratio=3)
        ids = distinct_prefixes(list(self.runs))
        for doc in reversed(self.runs.values()):
            stamp = time.strftime("%H:%M:%S", time.localtime(doc["updated_at"])) if doc.get("updated_at") else "-"
            cells = [stamp, f"[{STATUS_STYLE[doc['status']]}]{doc['status']}[/]", fmt_score(doc["score"]),
                     f"{doc['checked']}/{doc['checked'] + doc['unchecked']}", subject_cell(doc), ids[doc["run_id"]]]
            if not narrow:
                cells += [str(doc["revision"]), run_unreported(doc)]
            units = [f"{unit} [{VERDICT_STYLE[verdict]}]{verdict}[/]" for unit, verdict in diverged_units(doc)]
            if reasons := no_truth_summary(doc):
                units.append(f"[{VERDICT_STYLE[Verdict.NO_TRUTH]}]NoTruth[/] {reasons}")
            table.add_row(*cells, "\n".join(units) or "-")
        counts = Counter(d["status"] for d in self.runs.values())
        summary = "  ".join(f"[{STATUS_STYLE[s]}]{s}[/] {counts[s]}" for s in STATUS_STYLE if counts[s])
        return Group(table, Text.from_markup(f"{self.state}   {summary}"))


def _connect(channel: grpc.Channel, timeout: float) -> bool:
    """Whether the channel connected (True) or failed to (False: refused, unreachable, a TLS failure),
    without waiting out ``timeout`` for a port that refuses at once; raises FutureTimeoutError when
    nothing answered within ``timeout`` (a silent host)."""
    settled = threading.Event()
    state: list[grpc.ChannelConnectivity] = []

    def on_change(connectivity: grpc.ChannelConnectivity) -> None:
        if connectivity in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            state.append(connectivity)
            settled.set()

    channel.subscribe(on_change, try_to_connect=True)
    try:
        if not settled.wait(timeout):
            raise grpc.FutureTimeoutError()
        return state[0] is grpc.ChannelConnectivity.READY
    finally:
        channel.unsubscribe(on_change)


def stream(target: WatchTarget, replay: int, on_state: Callable[[str], None],
           max_backoff: float = 10.0, connect_timeout: float = 5.0) -> Iterator[tuple[dict[str, Any], bool]]:
    """(run document, replayed) from the collector, forever, reconnecting with backoff; ``replayed``:
    a stored run sent on (re)connect rather than a new verdict."""
    delay = 0.5
    connected = False
    while True:
        channel = target.channel()
        try:
            if _connect(channel, connect_timeout):
                connected = True
                on_state(f"connected to {target.endpoint}")
            # else the call below fails at once (it does not wait for the channel), with gRPC's reason
            for message in FidelityServiceStub(channel).WatchVerdicts(target.request(replay),
                                                                      metadata=target.metadata()):
                delay = 0.5
                yield to_doc(message), message.replayed
            reason = "the collector closed the stream"
        except grpc.RpcError as exc:
            if exc.code() in FATAL_CODES:
                raise WatchFatal(f"{target.endpoint}: {exc.code().name}: {exc.details()}") from exc
            reason = f"{exc.code().name}: {exc.details()}"
        except grpc.FutureTimeoutError:
            reason = f"no answer within {connect_timeout:g}s"
        finally:
            channel.close()
        wait = delay * random.uniform(0.8, 1.2)
        lost = "disconnected from" if connected else "no collector answering at"
        on_state(f"[yellow]{lost}[/] {target.endpoint} ({escape(reason)}); retrying in {wait:.1f}s "
                 "(is `agenteval collector serve` running there? its gRPC port)")
        time.sleep(wait)
        delay = min(delay * 2, max_backoff)


def watch(target: WatchTarget, console: Console, err: Console, rows: int, replay: int, count: int | None,
          as_json: bool) -> None:
    """Follow verdicts until interrupted, or until ``count`` new ones have been shown (replayed stored
    runs are shown for context but not counted)."""
    board = Board(rows)
    shown: OrderedDict[str, int] = OrderedDict()  # run id -> newest revision shown (bounded)
    remember = max(1000, 10 * replay)
    total = 0
    live = (Live(board.render(console.width), console=console, auto_refresh=False)
            if console.is_terminal and not as_json else None)

    def on_state(state: str) -> None:
        board.state = state
        if live is not None:
            live.update(board.render(console.width), refresh=True)
        else:
            err.print(state, highlight=False, soft_wrap=True)

    if live is not None:
        live.start()
    on_state(f"connecting to {target.endpoint}")
    try:
        for doc, replayed in stream(target, replay, on_state):
            if shown.get(doc["run_id"], 0) >= doc["revision"]:  # replayed again after a reconnect
                continue
            shown.pop(doc["run_id"], None)
            shown[doc["run_id"]] = doc["revision"]
            if len(shown) > remember:
                shown.popitem(last=False)
            board.add(doc)
            if live is not None:
                live.update(board.render(console.width), refresh=True)
            elif as_json:
                print(json.dumps(doc), flush=True)
            else:
                console.print(run_line(doc), highlight=False, soft_wrap=True)
            total += not replayed
            if count is not None and total >= count:
                return
    finally:
        if live is not None:
            live.stop()
