"""The live pipeline, transport-free: decoded requests in; verdicts out to every sink.

receive (``receivers``) -> decode -> assemble + classify (``assembler``) -> reconcile -> emit
(verdict spans and the log line per run; then, per sweep, metrics and the store writer).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from collector.config import CollectorConfig
from collector.core.model import Failure
from collector.core.reconcile import reconcile
from collector.formats.decode import Decoded
from collector.live import logs
from collector.live.assembler import Assembler, Backpressure, Finalized
from collector.live.handover import Handover, merged_note, split_note
from collector.live.journal import Journal, decode, encode
from collector.live.retry import Backoff
from collector.live.spanlog import SpanLog
from collector.live.store_writer import StoreWriter
from collector.outputs.emit_spans import VerdictSpans
from collector.outputs.metrics import Metrics
from collector.outputs.pricing import Pricing
from collector.store import Retention, RunStore, StoredRun, StoreError, instance_name, replaces
from collector.store.base import Part

log = structlog.get_logger("agenteval.collector")

SOURCE_LIVE = "live"

#: Seconds between asking a store that could not be read what it holds of replayed runs: first, most.
CHECK_RETRY = (1.0, 30.0)


@dataclass(frozen=True, slots=True)
class IngestResult:
    rejected: int
    message: str
    #: Resolves once the accepted spans are durable (None: nothing to wait for): answer only then.
    durable: asyncio.Future | None = None


@dataclass(slots=True)
class _Unstored:
    """A trace's runs published but not yet stored."""

    runs: int = 0
    #: The span log's mark when the trace was last settled.
    mark: int = 0
    settled: bool = False


class Pipeline:
    def __init__(self, config: CollectorConfig, store: RunStore, metrics: Metrics | None,
                 spans: VerdictSpans | None, store_url: str = "", offsets: SpanLog | None = None) -> None:
        """``offsets``: with the kafka receiver, Kafka is the durable log and its offsets are the span
        log in place of the journal (settled, stored traces release their messages instead of journal
        records). Nothing runs until :meth:`start`."""
        self.config = config
        self.instance = config.instance or instance_name()
        self.matcher = config.matcher()
        self.policy = config.scoring.policy()
        self.pricer = Pricing(config.pricing) if config.pricing.enabled else None
        # Hand-over (docs/scale-out.md): on by default where the store is shared by replicas.
        handover = config.assembly.handover
        if handover is None:  # on with a shared store, off where Kafka keeps every trace on one replica
            handover = store.notifies_all_writers and not config.receivers.kafka.enabled
        self.assembler = Assembler(config.assembly, self.matcher, handover=handover)
        self.handover = (Handover(store, self.instance, config.assembly.sweep_interval, config.assembly.max_trace_wait)
                         if handover else None)
        self.metrics = metrics
        self.spans = spans
        self.writer = StoreWriter(store, self._stored,
                                  (lambda: metrics.store_errors.add(1)) if metrics else (lambda: None),
                                  self._store_failed, lambda parts: self._done(p.trace_id for p in parts))
        self.store = store
        #: The most recent traces or runs that could not be finalized, published or stored (run page).
        self.failures: deque[Failure] = deque(maxlen=100)
        # A trace cut short at shutdown stays journaled as long as its late spans would be taken.
        self.journal = (Journal(config.journal.directory(store_url), config.journal.segment_bytes,
                                config.journal.max_bytes,
                                keep_cut_for=max(config.assembly.late_window, config.assembly.max_trace_wait))
                        if offsets is None and config.journal.enabled else None)
        #: Where accepted spans stay until their runs are stored: Kafka's offsets, or the journal.
        self.spanlog: SpanLog | None = offsets if offsets is not None else self.journal
        #: Called after spans are accepted with the deadline of their traces' quiet period, so a
        #: sweeper sleeping past it can wake (set by the server; the pipeline knows no event loop).
        self.on_deadline: Callable[[float], None] = lambda due: None
        #: Trace -> its runs not yet stored (see :meth:`_settle`).
        self._unstored: dict[str, _Unstored] = {}
        self._unstored_lock = threading.Lock()
        #: Traces replayed from the journal, not yet settled: their runs are checked against the
        #: store before they are published (see :meth:`_not_yet_stored`).
        self._replayed: set[str] = set()
        #: Replayed traces whole in the journal since a shutdown cut them (its manifest's first
        #: cuts), not yet finalized: what arrives for them extends the run the store holds.
        self._awaited: set[bytes] = set()
        #: Of those, the ones spans arrived for since the replay (hex; until their runs are checked).
        self._grown: set[str] = set()
        #: Runs of replayed traces waiting for the store to say what it holds of them, by trace (hex),
        #: and when to ask it again.
        self._unchecked: dict[str, list[Finalized]] = {}
        self._check_at = 0.0
        self._check_backoff = Backoff(*CHECK_RETRY)

    def start(self) -> None:
        """Start the threads the pipeline owns (the journal's, the store writer's, the hand-over's)
        and the store's retention sweeper. Then :meth:`replay`, before any receiver opens."""
        if self.journal is not None:
            self.journal.start()
        self.writer.start()
        if self.handover is not None:
            self.handover.start()
        kept, metrics = self.config.store.retention, self.metrics
        self.store.start_sweeping(Retention(kept.max_age, kept.max_size, self.config.assembly.late_window,
                                            kept.sweep_interval, kept.batch),
                                  metrics.runs_deleted.add if metrics else lambda deleted: None)

    def gauges(self) -> dict[str, float]:
        a = self.assembler
        return {"traces_in_flight": a.traces_in_flight, "spans_in_flight": a.spans_in_flight,
                "late_traces": a.late_traces, "late_bytes": a.late_bytes, "store_queued_runs": self.writer.backlog,
                "journal_bytes": self.journal.size if self.journal is not None else 0,
                "store_bytes": self.store.size, "store_oldest_run_timestamp_seconds": self.store.oldest_kept or 0}

    def admit(self, spans: Callable[[], int], transport: str) -> None:
        """Refuse a request before it is decoded when the journal or the store backlog is full, so
        refusing under sustained load costs no decoding. ``spans`` counts the request's spans: called
        only to refuse it (for the metric and the log), so an admitted request is walked once. What it
        raises (a payload that is not a request) is raised instead, with nothing counted as refused."""
        try:
            self._check_backlogs()
        except Backpressure as exc:
            self._refused(exc, spans(), transport)
            raise

    def _check_backlogs(self) -> None:
        if self.journal is not None and self.journal.full():
            raise Backpressure(f"journal.max_bytes ({self.config.journal.max_bytes}) of spans are waiting for "
                               "their traces to complete", self.config.assembly.retry_after)
        store = self.config.store
        if self.writer.backlog >= (limit := self.writer.queue_limit(store.max_queue_seconds, store.max_queued_runs)):
            raise Backpressure(f"store.max_queued_runs: {limit} verdicts ({store.max_queue_seconds:g} s of the "
                               "run store's writes, at most max_queued_runs) are waiting for the run store",
                               self.config.assembly.retry_after)

    def _refused(self, exc: Backpressure, spans: int, transport: str) -> None:
        if self.metrics:
            reason = exc.reason.partition(".")[0] if exc.reason.startswith(("store.", "journal.")) else "capacity"
            reason = {"store": "store_backlog"}.get(reason, reason)
            self.metrics.refused.add(spans, {"reason": reason, "transport": transport})
        log.warning("request_refused", transport=transport, spans=spans, reason=exc.reason)

    def ingest_decoded(self, decoded: Decoded, transport: str, at: tuple[int, int] | None = None) -> IngestResult:
        """Accept decoded span records, or raise :class:`Backpressure` having accepted none of them.
        ``at``: the (partition, offset) of the Kafka message they came in (:meth:`SpanLog.append`)."""
        try:
            self._check_backlogs()
            self.assembler.check_capacity(len(decoded.spans), (s.trace_id for s in decoded.spans))
        except Backpressure as exc:
            self._refused(exc, len(decoded.spans), transport)
            raise
        offer = self.assembler.offer(decoded.spans)
        if offer.accepted:
            self.on_deadline(self.assembler.clock() + self.config.assembly.quiet_period)
            if self._awaited:  # (a duplicate of a replayed span counts too: it costs a row, not a verdict)
                self._grown.update(s.trace_id.hex() for s in decoded.spans if s.trace_id in self._awaited)
        # Duplicates are journaled again: an exporter retries a request whose journal write failed.
        durable = (self._append(decoded, offer.idle, at)
                   if self.spanlog is not None and (offer.accepted or offer.duplicates) else None)
        rejected = decoded.rejected + offer.expired
        messages = list(decoded.reasons)
        messages.extend(f"{n} span(s) belong to traces {why}" for why, n in offer.expired_why.items())
        if self.metrics:
            m = self.metrics
            m.received.add(offer.accepted, {"transport": transport})
            if offer.duplicates:
                m.duplicates.add(offer.duplicates, {"transport": transport})
            if decoded.own:
                m.own.add(decoded.own, {"transport": transport})
            if decoded.rejected:
                m.rejected.add(decoded.rejected, {"transport": transport, "reason": "invalid_span"})
            if offer.expired:
                m.rejected.add(offer.expired, {"transport": transport, "reason": "late"})
        if rejected:
            log.warning("spans_rejected", transport=transport, rejected=rejected, reasons=messages[:5])
        return IngestResult(rejected, "; ".join(messages[:5]), durable)

    def replay(self) -> int:
        """Re-accept the spans of an earlier run's journal (before the receivers open); their traces
        then complete as usual. Returns the number of spans replayed."""
        if self.journal is None:
            return 0
        spans = 0
        self._awaited = set(self.journal.first_cut)
        for batch in self.journal.replay(self.matcher):
            spans += self.assembler.offer(batch).accepted
            self._replayed.update(span.trace_id.hex() for span in batch)
        return spans

    def _not_yet_stored(self, finalized: list[Finalized]) -> tuple[list[Finalized], list[Finalized]]:
        """Runs of replayed traces are checked against the store before they are published: those
        it holds already (a journal segment outlives stored traces while another trace in it is
        open) are not published again; the others number on from the revision it holds (it numbers
        a complete verdict over an incomplete one past it). The store's own rule decides
        (:func:`collector.store.replaces`). While the store cannot answer, they wait, and the later
        revisions of their traces with them, asked again with backoff (not at all while it is not
        open yet): published unchecked, a run the store numbered past this collector's count made
        the next revision stale.

        Returns the runs to publish, and the runs of this sweep to count as not yet stored."""
        checked = self._replayed | self._unchecked.keys()
        mine = [item for item in finalized if item.run.trace_id in checked]
        if not mine and not self._unchecked:
            return finalized, finalized
        others = [item for item in finalized if item.run.trace_id not in checked]
        self._awaited.difference_update(bytes.fromhex(item.run.trace_id or "") for item in mine)
        earlier = [item for items in self._unchecked.values() for item in items]  # counted when they came
        items = earlier + mine
        now = self.assembler.clock()
        stored = None
        if now >= self._check_at and self.writer.store.is_open:
            try:
                stored = self.writer.store.revisions(list({item.run.run_id or "" for item in items}))
            except StoreError as exc:
                delay = self._check_backoff.failed()
                log.warning("replay_check_failed", error=str(exc), waiting_runs=len(items), retry_in=delay)
                self._check_at = now + delay
        if stored is None:
            for item in mine:
                self._unchecked.setdefault(item.run.trace_id or "", []).append(item)
            return others, finalized
        self._unchecked.clear()
        self._check_backoff.reset()
        grown = self._grown & {item.run.trace_id for item in items}
        self._grown -= grown
        grown |= {item.run.trace_id for item in items if item.parts}  # a part claimed holds what the store lacks
        latest = {item.run.run_id: item for item in items}  # a later revision holds all an earlier one did
        publish, counted, dropped = list(others), list(others), []
        new = {id(item) for item in mine}
        for item in items:
            held = stored.get(item.run.run_id or "")
            last = latest[item.run.run_id]
            # numbered past the stored one: complete over incomplete, a kept trace grown since its
            # replay, or a revision made by late spans while it waited
            if last is item and (held is None or replaces(held, item.revision, item.run.incomplete)
                                 or item.run.trace_id in grown or item.revision > 1):
                if held is not None:
                    item.revision = max(item.revision, held[0] + 1)
                publish.append(item)
                if id(item) in new:
                    counted.append(item)
            else:
                if id(item) not in new:
                    dropped.append(item.run.trace_id)
                if last is item:
                    self._spend(item.parts)  # the store holds its run
                else:
                    last.parts += item.parts  # held by its later revision
            if held is not None:
                self.assembler.revise(bytes.fromhex(item.run.trace_id or ""), item.run.run_id or "",
                                      max(item.revision, held[0]))
        self._done(dropped)
        return publish, counted

    def next_deadline(self) -> float:
        """Monotonic time the next :meth:`sweep` is due."""
        return self.assembler.next_deadline(self.assembler.clock())

    def _merge_claimed(self) -> None:
        """Merge the parts claimed since the last look; those whose trace takes no more spans here
        go back to waiting."""
        assert self.handover is not None
        handover, assembler = self.handover, self.assembler
        for trace_id, parts, adopt in handover.claimed():
            tid = bytes.fromhex(trace_id)
            for part in parts:
                spans = [span for line in part.records.splitlines() if line.strip()
                         for span in decode(line, self.matcher)]
                accepted = assembler.merge(tid, spans, part.held_by, adopt, part.part_id)
                if accepted is None:
                    handover.release([part.part_id])
                elif accepted and self.spanlog is not None:
                    self.spanlog.append(spans)  # durable here before its trace is settled
            if parts:
                self.on_deadline(assembler.clock())
                if self.metrics is not None:
                    self.metrics.parts.add(len(parts), {"event": "split" if adopt else "merged"})

    def _merge_parts(self) -> frozenset[bytes]:
        """Merge the parts claimed since the last sweep, and claim those waiting for traces this
        replica holds with their root (or that no such replica claimed in time: adopted); returns
        the traces to hold from finalization while their claims are answered."""
        assert self.handover is not None
        handover, assembler = self.handover, self.assembler
        self._merge_claimed()
        wait = self.config.assembly.max_trace_wait
        for trace_id, parts in list(handover.waiting.items()):
            if trace_id in handover.pending:
                continue
            if assembler.holds_root(bytes.fromhex(trace_id)):
                handover.request(trace_id, adopt=False)
            elif handover.orphaned(parts, wait):
                handover.request(trace_id, adopt=True)
        return frozenset(bytes.fromhex(t) for t in handover.pending)

    def sweep(self, force: bool = False) -> int:
        hold = self._merge_parts() if self.handover is not None and not force else frozenset()
        swept = self.assembler.sweep(force, hold)
        self._spend(swept.spent)
        if swept.handed:
            self.writer.put_parts([Part(tid.hex(), self.instance, False, len(records), encode(records))
                                   for tid, records in swept.handed])
            if self.metrics is not None:
                self.metrics.parts.add(len(swept.handed), {"event": "handed_over"})
        for failure in swept.failures:
            self._failed(failure)
        finalized = counted = swept.finalized
        if self._replayed or self._unchecked:
            finalized, counted = self._not_yet_stored(finalized)
        cut = self._keep(swept.cut)
        if self.journal is not None and self.journal.first_cut:  # kept for their rest: it came, or no run will
            self.journal.unpin([bytes.fromhex(item.run.trace_id) for item in finalized
                                if item.run.trace_id and not item.run.incomplete] + swept.ignored)
        if swept.ignored and self.metrics is not None:
            self.metrics.ignored.add(len(swept.ignored))
        if self.spanlog is not None:
            self._settle(counted, swept.settled, cut, [tid.hex() for tid, _ in swept.handed])
        published: list[tuple[StoredRun, float | None]] = []
        try:
            for item in finalized:
                try:
                    published.append((self._publish(item), item.root_arrived))
                except Exception as exc:  # one run that cannot be published costs no other
                    self._failed(Failure(item.run.run_id or item.run.trace_id or "", "publish",
                                         f"{type(exc).__name__}: {exc}"[:200]))
                    self._done([item.run.trace_id])
                    self._spend(item.parts)
                if len(published) == StoreWriter.BATCH:  # the writer starts on a long sweep's first batch
                    batch, published = published, []
                    self._hand_over(batch)
        finally:
            self._hand_over(published)
        return len(finalized)

    def _keep(self, cut: list[bytes]) -> set[bytes]:
        """Of the traces cut short at shutdown, those the journal keeps, so the rest of them, sent to
        the next collector, completes their runs: for as long as their late spans would be taken
        had the collector run on (:attr:`Journal.keep_cut_for`) from when a collector first cut
        them (a collector restarting faster would otherwise keep them for good). Not one the
        journal may hold only part of: replayed, not kept whole by the last close, and with runs in
        the store (its earlier spans let go once they were stored, as after a kill -9); its rest
        would be reconciled as if it were the whole. A store that cannot say keeps none of those."""
        if self.journal is None or not cut:
            return set()
        doubtful = [tid.hex() for tid in cut if tid.hex() in self._replayed and tid not in self.journal.first_cut]
        try:
            partial = self.writer.store.traces_with_runs(doubtful) if doubtful else set()
        except StoreError as exc:
            log.warning("cut_trace_check_failed", error=str(exc), traces=len(doubtful))
            partial = set(doubtful)
        now = time.time()
        kept = {}
        for tid in cut:
            first = self.journal.first_cut.get(tid, now)
            if now - first < self.journal.keep_cut_for and tid.hex() not in partial:
                kept[tid] = first
        self.journal.cut(kept)
        return set(kept)

    def _hand_over(self, published: list[tuple[StoredRun, float | None]]) -> None:
        """Published runs to the metrics, then to the store writer, together: handed over one by one,
        the writer woke for the first and wrote batches of one or two. Last, so a stored run implies
        every other sink saw it."""
        if not published:
            return
        if self.metrics is not None:
            try:
                self.metrics.record_runs([stored for stored, _ in published])
            except Exception:  # failing metrics cost no run its store write or the sweep its rest
                log.exception("metrics_record_failed", runs=len(published))
        self.writer.put([(stored.for_writer(), arrived) for stored, arrived in published])

    def _append(self, decoded: Decoded, idle: frozenset[bytes], at: tuple[int, int] | None) -> asyncio.Future | None:
        """Keep an accepted request in the span log. A trace nothing will settle again is not waited
        for, unless runs of it are still to be stored (a retry of a request whose write failed,
        arriving after the trace was finalized from memory): then the release it waits for covers
        this request."""
        assert self.spanlog is not None
        if not idle:
            return self.spanlog.append(decoded.spans, decoded.journal_line, at=at)
        with self._unstored_lock:  # against _done letting the trace go meanwhile
            waiting = [tid for tid in idle if tid.hex() in self._unstored]
            durable = self.spanlog.append(decoded.spans, decoded.journal_line, idle.difference(waiting), at)
            mark = self.spanlog.mark()
            for tid in waiting:
                self._unstored[tid.hex()].mark = mark
        return durable

    def _settle(self, finalized: list[Finalized], swept: list[bytes], kept: set[bytes], handed: list[str]) -> None:
        """A trace's spans are let go once it is settled (nothing of it waits for a parent; ``swept``:
        the traces this sweep settled) and every run published from it is stored, up to the span
        log's mark when it was last settled: spans appended later belong to a revision not yet
        stored. ``kept``: traces cut short at shutdown, journaled until the rest of them, sent to the
        next collector, completes their runs."""
        settled = {tid.hex(): tid for tid in swept if tid not in kept}
        self._replayed.difference_update(settled)  # replayed traces that made no run are done too
        self._awaited.difference_update(settled.values())
        self._grown.difference_update(t for t in settled if t not in self._unchecked)
        assert self.spanlog is not None
        mark = self.spanlog.mark()
        released = []
        with self._unstored_lock:
            for item in finalized:  # settled or not: a trace still waiting can have published runs
                if item.run.trace_id:
                    self._unstored.setdefault(item.run.trace_id, _Unstored()).runs += 1
            for trace_id in handed:  # a part handed over counts as a run until it is stored
                self._unstored.setdefault(trace_id, _Unstored()).runs += 1
            for hex_id, tid in settled.items():
                entry = self._unstored.get(hex_id)
                if entry is None:
                    released.append((tid, mark))
                else:
                    entry.settled, entry.mark = True, mark
        self.spanlog.release(released)  # every sweep, with nothing released too: expired pins go then

    def _done(self, trace_ids: Iterable[str | None]) -> None:
        """Runs are stored (or failed for good); the span log lets go of a settled trace once all
        its runs are, in one call per batch."""
        if self.spanlog is None:
            return
        released = []
        with self._unstored_lock:
            for trace_id in trace_ids:
                if trace_id is None or (entry := self._unstored.get(trace_id)) is None:
                    continue
                entry.runs -= 1
                if entry.runs <= 0:
                    del self._unstored[trace_id]
                    if entry.settled:  # else its settling lets it go
                        released.append((bytes.fromhex(trace_id), entry.mark))
        if released:
            self.spanlog.release(released)

    def _store_failed(self, run: StoredRun, error: str) -> None:
        self._failed(Failure(run.run_id, "store", error))
        self._done([run.trace_id])
        self._spend(run.parts)

    def _spend(self, part_ids: Iterable[str]) -> None:
        """Claimed parts merged into no run to store: dropped from the store."""
        if self.handover is not None and (part_ids := list(part_ids)):
            self.handover.spend(part_ids)

    def _failed(self, failure: Failure) -> None:
        """Counted, logged and kept for the run page; never raised into a stage."""
        self.failures.append(failure)
        if self.metrics is not None:
            self.metrics.failed.add(1, {"stage": failure.stage})
        log.error("run_failed", id=failure.id, stage=failure.stage, error=failure.error)

    def _publish(self, item: Finalized) -> StoredRun:
        """Reconcile a finalized run and hand it to every sink but the store (the sweep queues its
        runs for the store together)."""
        # parts of its own a replica handed over and claimed back (the root came to it after all): not news
        spans = {replica: n for replica, n in (item.merged or {}).items() if replica != self.instance or item.adopted}
        if spans:
            run = item.run
            if item.adopted:  # parts no replica with the root claimed: reconciled apart
                run.split = True
                run.notes = (*run.notes, split_note([Part(run.trace_id or "", r, False, n, b"") for r, n in
                                                     sorted(spans.items())], self.instance))
            else:
                run.notes = (*run.notes, merged_note(spans, self.instance))
        verdict = reconcile(item.run, self.policy, self.config.scoring.preset, item.revision, self.pricer)
        run_id = item.run.run_id or verdict.trace_id or ""
        if self.spans is not None:
            anchor = item.run.root_span_id or next(
                (e.span_ids[0] for e in item.run.executors if e.span_ids), None)
            self.spans.emit(verdict, run_id, anchor)
        logs.info(
            log, "run_verdict", run_id=run_id, trace_id=verdict.trace_id, subject=verdict.subject,
            status=verdict.status.value, score=verdict.score, revision=verdict.revision,
            incomplete=verdict.incomplete, checked=verdict.checked, unchecked=verdict.unchecked,
            executors={e.executor_id: e.verdict.value for e in verdict.executors},
            no_truth={e.executor_id: e.no_truth_reason.value for e in verdict.executors if e.no_truth_reason},
        )
        return StoredRun.packed(run_id, SOURCE_LIVE, verdict, self.instance, item.parts, self.writer.store.max_items)

    def _stored(self, batch: list[tuple[StoredRun, float | None]]) -> None:
        self._done(run.trace_id for run, _ in batch)
        if self.handover is not None:
            self.handover.stored(part for run, _ in batch for part in run.parts)
        if self.metrics is not None:
            now = time.monotonic()
            for _, arrived in batch:
                if arrived is not None:
                    self.metrics.latency.record(now - arrived)

    def close(self) -> int:
        """Finalize every in-flight trace (flagged incomplete where it was), the parts claimed for
        them merged first, flush the store, and close the journal. It keeps the spans of the traces
        cut short (and of any whose write failed): they replay on the next start, so the rest of a
        trace, sent there, completes its run. Claims whose runs were not stored are released.
        Returns how many traces it keeps."""
        if self.handover is not None:
            self.handover.close()
            self._merge_claimed()  # into the runs stored now
        self.sweep(force=True)
        self.writer.close()
        if self.handover is not None:
            self.handover.finish()  # claims whose runs were not stored: for another replica
        return self.journal.close() if self.journal is not None else 0
