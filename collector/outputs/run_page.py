"""The read-only run page on the collector's HTTP port: ``/runs``, ``/runs/{id}`` and the stored
document itself, ``/runs/{id}.json``.

Server-rendered (jinja2, autoescaped) from the stored run documents, so it needs no JavaScript and
shows exactly what ``agenteval runs show`` shows: numbers, reasons and span ids, never prompt text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import urlencode

import jinja2
import structlog
from aiohttp import web

from collector.core.model import (
    Failure,
    Status,
    Usage,
    fmt_duration,
    fmt_maf_release,
    fmt_over_report,
    fmt_started,
    fmt_usd,
    ledger_package,
)
from collector.core.serialize import to_json
from collector.core.spend import known_spend
from collector.security import BearerAuth
from collector.store import RETRY_READ_AFTER, UNREADABLE, RunStore, StoreError

log = structlog.get_logger("agenteval.collector")

MAX_ROWS = 500
T = TypeVar("T")

_env = jinja2.Environment(loader=jinja2.PackageLoader("collector.outputs", "templates"),
                          autoescape=jinja2.select_autoescape(default=True), undefined=jinja2.StrictUndefined)
_env.filters["score"] = lambda v: "–" if v is None else f"{v:.3f}"
_env.filters["num"] = lambda v: "–" if v is None else f"{v:,}"
#: A usage's total as it is compared: input + output where either is known, else the reported total.
_env.filters["total"] = lambda usage: Usage(**usage).total
_env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "–"
_env.filters["started"] = fmt_started
_env.filters["duration"] = fmt_duration
_env.filters["usd"] = fmt_usd
_env.filters["maf_release"] = fmt_maf_release
_env.filters["over_report"] = fmt_over_report
_env.filters["ledger_package"] = lambda runtime: ledger_package(runtime == "dotnet")
_env.globals["statuses"] = [s.value for s in Status]
_env.globals["known_spend"] = known_spend


#: The runs page's time ranges: how far back it lists and counts runs (by when each was last written).
RANGES: dict[str, float | None] = {"15m": 900.0, "1h": 3600.0, "6h": 21600.0, "24h": 86400.0, "7d": 604800.0,
                                   "all": None}
DEFAULT_RANGE = "all"


async def _to_runs(_: web.Request) -> web.StreamResponse:
    return web.HTTPFound("/runs")


class RunPage:
    def __init__(self, store: RunStore, auth: BearerAuth, trace_url: str | None,
                 failures: Callable[[], Iterable[Failure]] = tuple, max_age: float | None = None) -> None:
        self.store = store
        #: How long the collector keeps runs (``store.retention.max_age``), said beside the history.
        self.max_age = max_age
        self.auth = auth
        self.trace_url = trace_url
        #: This collector's recent traces and runs that could not be finalized, published or stored.
        self.failures = failures

    def register(self, app: web.Application) -> None:
        app.router.add_get("/", _to_runs)
        app.router.add_get("/runs", self.runs)
        app.router.add_get("/runs/", _to_runs)
        app.router.add_get("/runs/{run_id}.json", self.run_json)  # before /runs/{run_id}, which would take it
        app.router.add_get("/runs/{run_id}", self.run)

    def _page(self, template: str, http_status: int = 200, **context: Any) -> web.Response:
        html = _env.get_template(template).render(**context)
        return web.Response(text=html, status=http_status, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                                     "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'"})

    async def _read(self, read: Callable[..., T], *args: Any) -> T:
        """A store read on a worker thread; a store that cannot answer is a 503 (retry)."""
        try:
            return await asyncio.to_thread(read, *args)
        except StoreError as exc:
            log.warning("store_read_failed", transport="http", error=str(exc))
            raise web.HTTPServiceUnavailable(text=UNREADABLE + "\n",
                                             headers={"Retry-After": str(RETRY_READ_AFTER)}) from None

    def _denied(self, request: web.Request) -> web.Response | None:
        if self.auth.allows(request.headers.get("Authorization")):
            return None
        return web.Response(status=401, text="missing or invalid bearer token\n",
                            headers={"WWW-Authenticate": "Bearer"})

    async def runs(self, request: web.Request) -> web.Response:
        if denied := self._denied(request):
            return denied
        status = request.query.get("status", "").upper()
        subject = request.query.get("subject") or None
        prefix = request.query.get("run_id") or None
        if status and status not in Status.__members__:
            return self._page("error.html", 400, title="bad request",
                              message=f"unknown status {status!r}: use PASS, WARN, FAIL or PENDING")
        try:
            limit = min(max(int(request.query.get("limit", 50)), 1), MAX_ROWS)
        except ValueError:
            return self._page("error.html", 400, title="bad request", message="limit must be a number")
        span = request.query.get("range") or DEFAULT_RANGE
        if span not in RANGES:
            return self._page("error.html", 400, title="bad request",
                              message=f"unknown range {span!r}: use {', '.join(RANGES)}")
        seconds = RANGES[span]
        since = time.time() - seconds if seconds is not None else None
        rows = await self._read(self.store.list_runs, [status] if status else (), subject, limit,
                                True, None, prefix, since)  # with each run's units and reasons
        counts = await self._read(self.store.count_by_status, subject, since)
        history = await self._read(self.store.history, self.max_age)
        return self._page("runs.html", rows=rows, status=status, subject=subject or "", run_id=prefix or "",
                          limit=limit, failures=list(self.failures())[::-1], history=history,
                          trace_url=self.trace_url, range=span, ranges=list(RANGES), counts=counts)

    async def run_json(self, request: web.Request) -> web.Response:
        """The stored run document, as ``agenteval runs show --json`` prints it."""
        if denied := self._denied(request):
            return denied
        run_id = request.match_info["run_id"]
        doc = await self._read(self.store.get_run, run_id)
        headers = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
        if doc is None:
            message = await self._read(self.store.missing_run, run_id, True)
            return web.Response(body=to_json({"error": message}), status=404, content_type="application/json",
                                headers=headers)
        return web.Response(body=to_json(doc), content_type="application/json", headers=headers)

    async def run(self, request: web.Request) -> web.Response:
        if denied := self._denied(request):
            return denied
        run_id = request.match_info["run_id"]
        doc = await self._read(self.store.get_run, run_id)
        if doc is None:
            if len(await self._read(self.store.runs_matching, run_id, 2)) > 1:
                # a trace id of a trace with several workflow runs: list them
                raise web.HTTPSeeOther(f"/runs?{urlencode({'run_id': run_id, 'limit': MAX_ROWS})}")
            message = await self._read(self.store.missing_run, run_id, True)
            return self._page("error.html", 404, title="not found", message=message)
        no_truth: dict[str, list[dict[str, Any]]] = {}  # unchecked units by reason, each reason explained once
        for e in doc["executors"]:
            if e["no_truth_reason"]:
                no_truth.setdefault(e["no_truth_reason"], []).append(e)
        span_url = self._span_url(doc["trace_id"])
        return self._page("run.html", run=doc, no_truth=no_truth, span_url=span_url,
                          trace_url=span_url(doc["root_span_id"]) if span_url else None)

    def _span_url(self, trace_id: str | None) -> Callable[[str | None], str] | None:
        """A span's link into the trace UI: ``ui.trace_url`` with the trace id, and the span id if it names one."""
        template = self.trace_url
        if not (template and trace_id):
            return None
        return lambda span_id: template.format(trace_id=trace_id, span_id=span_id or "")
