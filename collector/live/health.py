"""Health on the OTLP/HTTP port, for probes and load balancers: ``GET /healthz`` (liveness) and
``GET /readyz`` (readiness). No bearer token: they tell states, never data or where the store is.

The journal is replayed before the port opens, so a collector that answers has replayed it.
"""

from __future__ import annotations

from aiohttp import web

from collector.live.store_writer import StoreWriter

#: Why a collector is not ready, by the run store's state.
NOT_READY = {
    "unavailable": "the run store could not be reached since the collector started (its log says why): spans "
                   "are still accepted and journaled, and their runs stored once it opens",
    "failing": "writes to the run store are failing and being retried (its log says why): verdicts queue "
               "meanwhile",
}


class Health:
    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        #: Set once the collector was told to stop and waits ``shutdown_delay`` (still accepting).
        self.stopping = False

    def register(self, app: web.Application) -> None:
        app.router.add_get("/healthz", self.live)
        app.router.add_get("/readyz", self.ready)

    async def live(self, _: web.Request) -> web.Response:
        """200 for as long as the process serves."""
        return web.json_response({"status": "alive"}, headers={"Cache-Control": "no-store"})

    async def ready(self, _: web.Request) -> web.Response:
        """200 when the run store is open and its writes land, and the collector is not stopping; else
        503 saying why."""
        store = ("unavailable" if not self.writer.store.is_open else "failing" if self.writer.failing else "open")
        ready = store == "open" and not self.stopping
        body: dict[str, object] = {"ready": ready, "store": store}
        if store != "open":
            body["reason"] = NOT_READY[store]
        elif self.stopping:
            body["reason"] = "the collector is stopping (shutdown_delay): it still accepts spans meanwhile"
        return web.json_response(body, status=200 if ready else 503, headers={"Cache-Control": "no-store"})
