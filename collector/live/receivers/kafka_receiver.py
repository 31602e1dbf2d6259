"""The ``kafka`` receiver (docs/scale-out.md "Kafka, exact"): OTLP protobuf trace requests from a topic.

Replicas consume the topic as one consumer group (librdkafka's client, ``confluent-kafka``, with
cooperative-sticky assignment: a rebalance moves only the partitions it must). Each message is
decoded with the receivers' decoder and fed to the same :meth:`Pipeline.ingest_decoded`; the rest of
the pipeline does not learn where spans came from.

Offsets are a promise about what was handled (:mod:`collector.live.receivers.kafka_offsets`): a
partition is committed only up to its oldest message holding a trace not yet stored, with the stored
traces past that offset named in the commit's metadata. A partition taken away drops its traces in flight
unpublished: the next owner re-reads them whole from the committed offset and skips the ones named.

A message that is not an OTLP trace request, larger than ``max_message_bytes``, or holding more
spans or traces than the assembly could ever take (:class:`Undecodable`, its fault the reason), is
counted and logged with its offset and skipped. Over capacity (:class:`Backpressure`) consumption
pauses and the message is read again after ``assembly.retry_after``; nothing is skipped. A broker
outage only stalls ingest: librdkafka reconnects, and the run page and API are served meanwhile.

Everything runs on the event loop, rebalance callbacks included (they are called from ``consume``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import structlog

from collector.config import ConfigError
from collector.config import KafkaReceiver as KafkaConfig
from collector.formats.decode import Decoded
from collector.live.assembler import Backpressure
from collector.live.pipeline import Pipeline
from collector.live.receivers.decoding import Fault, Undecodable, check_fits, decode
from collector.live.receivers.kafka_offsets import KafkaOffsets
from collector.live.receivers.limits import MAX_REASON_BYTES, OFFLOAD_BYTES, clip
from collector.live.receivers.telemetry import Telemetry

log = structlog.get_logger("agenteval.collector")

TRANSPORT = "kafka"
#: Messages taken per ``consume`` call, and seconds slept when none came (the call never blocks
#: the event loop).
BATCH = 500
IDLE_SLEEP = 0.05
#: Seconds between two log lines about the same client error (a broker outage repeats them).
ERROR_LOG_INTERVAL = 10.0
#: Longest wait at shutdown for runs already published to be stored before the final commit.
STOP_FLUSH_TIMEOUT = 10.0


def kafka_client() -> Any:
    """confluent-kafka (the distribution's ``kafka`` extra), or a config error saying how to install it."""
    try:
        import confluent_kafka
    except ImportError as exc:
        raise ConfigError("receivers.kafka.enabled: the kafka receiver needs confluent-kafka, which is not "
                          "installed: pip install 'agenteval-collector[kafka]'") from exc
    return confluent_kafka


def _detail(exc: Undecodable) -> str:
    """What the log says of a message skipped: the decoder's own error where a decoder refused it."""
    cause = exc.__cause__
    return exc.message if cause is None else clip(f"{type(cause).__name__}: {cause}", MAX_REASON_BYTES)


class KafkaTraceReceiver:
    """The consumer: made, subscribed and polled from :meth:`start`; :meth:`stop` commits and leaves
    the group."""

    def __init__(self, config: KafkaConfig, pipeline: Pipeline, offsets: KafkaOffsets) -> None:
        self.config = config
        self.pipeline = pipeline
        self.offsets = offsets
        self.telemetry = Telemetry(TRANSPORT, pipeline.metrics)
        self._ck: Any = None
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        #: (partition, offset) -> metadata of the last commit asked for (forgotten when it fails).
        self._committed: dict[int, tuple[int, str]] = {}
        self._next_commit = 0.0
        self._resume_at: float | None = None
        self._logged: dict[str, float] = {}

    def _client_config(self) -> dict[str, Any]:
        cfg = self.config
        return {
            **cfg.client,
            "bootstrap.servers": ",".join(cfg.brokers),
            "group.id": cfg.group_id,
            "client.id": cfg.client_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": cfg.initial_offset,
            "partition.assignment.strategy": "cooperative-sticky",
            "on_commit": self._on_commit,
            "error_cb": self._on_error,
            "logger": logging.getLogger("agenteval.kafka"),
        }

    async def start(self) -> None:
        self._ck = kafka_client()
        consumer = self._ck.Consumer(self._client_config())
        try:
            consumer.subscribe([self.config.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                               on_lost=self._on_lost)
        except BaseException:
            consumer.close()
            raise
        self._consumer = consumer
        self._task = asyncio.create_task(self._run())
        log.info("kafka_receiver_started", brokers=self.config.brokers, topic=self.config.topic,
                 group_id=self.config.group_id)

    # --- consuming ------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                idle = await self._step()
            except Exception:  # a bug in one step must not stop ingest for good
                log.exception("kafka_receiver_step_failed")
                idle = True
            await asyncio.sleep(IDLE_SLEEP if idle else 0)  # the receivers and the sweeper run between batches

    async def _step(self) -> bool:
        """Consume and handle one batch, commit when due; True when there was nothing to consume."""
        consumer = self._consumer
        if self._resume_at is not None and time.monotonic() >= self._resume_at:
            self._resume_at = None
            consumer.resume(self._partitions(self.offsets.owned()))
        try:
            messages = consumer.consume(BATCH, 0)
        except self._ck.KafkaException as exc:
            self._error("kafka_consume_failed", str(exc))
            messages = []
        for index, message in enumerate(messages):
            try:
                handled = await self._handle(message)
            except Exception as exc:  # one message never stops its partition or the others
                self._skipped("failed", f"{type(exc).__name__}: {exc}"[:MAX_REASON_BYTES], message.partition(),
                              message.offset())
                self.offsets.taken(message.partition(), message.offset())
                continue
            if not handled:
                self._hold(messages[index:])
                break
        if time.monotonic() >= self._next_commit:
            self._next_commit = time.monotonic() + self.config.commit_interval
            self._commit(self.offsets.owned(), asynchronous=True)
        return not messages

    async def _handle(self, message: Any) -> bool:
        """Ingest one message; False when the pipeline is over capacity (nothing of it accepted)."""
        if message.error() is not None:
            self._error("kafka_error", str(message.error()))
            return True
        partition, offset = message.partition(), message.offset()
        if partition not in self.offsets.owned():
            return True  # fetched before its partition was taken away
        try:
            decoded = await self._decode(message.value())
            spans = decoded.spans
            decoded.spans = [s for s in spans if not self.offsets.skips(partition, offset, s.trace_id)]
            if len(decoded.spans) != len(spans):
                decoded.journal_line = None
            check_fits(decoded, self.pipeline.config.assembly, self.telemetry)  # retrying would block the partition
        except Undecodable as exc:
            self._skipped(exc.fault.value, _detail(exc), partition, offset)
            self.offsets.taken(partition, offset)
            return True
        if decoded.spans or decoded.rejected or decoded.own:
            try:
                self.pipeline.ingest_decoded(decoded, TRANSPORT, at=(partition, offset))
            except Backpressure:
                return False
        self.offsets.taken(partition, offset)
        return True

    async def _decode(self, value: bytes | None) -> Decoded:
        if value is None:
            raise Undecodable(Fault.INVALID, "empty message")
        if len(value) > self.config.max_message_bytes:
            raise Undecodable(Fault.TOO_LARGE,
                              f"{len(value)} bytes, over max_message_bytes ({self.config.max_message_bytes})")
        if len(value) >= OFFLOAD_BYTES:
            return await asyncio.to_thread(decode, value, self.pipeline.matcher)
        return decode(value, self.pipeline.matcher)

    def _hold(self, unhandled: list[Any]) -> None:
        """Over capacity: read ``unhandled`` again (from its first message per partition) once
        ``assembly.retry_after`` has passed; consumption pauses meanwhile (rebalances still run)."""
        first: dict[int, int] = {}
        for message in unhandled:
            if message.error() is None and message.partition() not in first:
                first[message.partition()] = message.offset()
        owned = self.offsets.owned()
        paused = self._partitions(owned)
        self._consumer.pause(paused)
        for partition, offset in first.items():
            if partition in owned:
                try:
                    self._consumer.seek(self._ck.TopicPartition(self.config.topic, partition, offset))
                except self._ck.KafkaException as exc:
                    self._error("kafka_seek_failed", str(exc))
        self._resume_at = time.monotonic() + self.pipeline.config.assembly.retry_after

    def _skipped(self, reason: str, detail: str, partition: int, offset: int) -> None:
        self.telemetry.skipped(reason, detail, self.config.topic, partition, offset)

    # --- offsets --------------------------------------------------------------------------------
    def _partitions(self, partitions: list[int]) -> list[Any]:
        return [self._ck.TopicPartition(self.config.topic, p) for p in partitions]

    def _commit(self, partitions: list[int], asynchronous: bool) -> None:
        """Commit each partition's :meth:`KafkaOffsets.commit_point` that changed since the last."""
        out = []
        for partition in partitions:
            point = self.offsets.commit_point(partition)
            if point is None or self._committed.get(partition) == (point.offset, point.metadata):
                continue
            if point.unnamed:
                log.warning("kafka_metadata_full", partition=partition, offset=point.offset, unnamed=point.unnamed,
                            max_metadata_bytes=self.config.max_metadata_bytes)
            self._committed[partition] = (point.offset, point.metadata)
            out.append(self._ck.TopicPartition(self.config.topic, partition, point.offset, metadata=point.metadata))
        if not out:
            return
        try:
            self._consumer.commit(offsets=out, asynchronous=asynchronous)
        except self._ck.KafkaException as exc:
            for tp in out:
                self._committed.pop(tp.partition, None)
            self._error("kafka_commit_failed", str(exc))

    def _on_commit(self, error: Any, partitions: list[Any]) -> None:
        failed = [tp.partition for tp in partitions if tp.error is not None]
        if error is not None or failed:
            for partition in failed or [tp.partition for tp in partitions]:
                self._committed.pop(partition, None)  # asked again at the next commit
            self._error("kafka_commit_failed", str(error or partitions[0].error))

    # --- rebalances -----------------------------------------------------------------------------
    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        try:
            committed = consumer.committed(partitions, timeout=30)
        except self._ck.KafkaException as exc:  # read from the start of what is committed: none named
            self._error("kafka_committed_failed", str(exc))
            committed = partitions
        for tp in committed:
            self.offsets.assign(tp.partition, tp.offset if tp.offset >= 0 else None, getattr(tp, "metadata", None))
            self._committed.pop(tp.partition, None)
        log.info("kafka_partitions_assigned", partitions=sorted(tp.partition for tp in committed),
                 skipped_traces={tp.partition: len(self.offsets.inherited(tp.partition)) for tp in committed})

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        """Drop the partitions' traces in flight unpublished (the next owner re-reads them whole),
        commit what is stored, and let them go."""
        self._let_go([tp.partition for tp in partitions], commit=True)

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        """Taken away without a chance to commit (this replica was out of the group too long)."""
        self._let_go([tp.partition for tp in partitions], commit=False)

    def _let_go(self, partitions: list[int], commit: bool) -> None:
        dropped = 0
        for partition in partitions:
            dropped += self.pipeline.assembler.discard(self.offsets.pending_traces(partition))
        if commit:
            self._commit(partitions, asynchronous=False)
        for partition in partitions:
            self.offsets.revoke(partition)
            self._committed.pop(partition, None)
        log.info("kafka_partitions_revoked", partitions=sorted(partitions), dropped_open_traces=dropped,
                 committed=commit)

    # --- lifecycle ------------------------------------------------------------------------------
    async def stop(self) -> None:
        """Stop consuming; drop the open traces (the next owner re-reads them whole), wait for the
        runs already published to be stored, commit, and leave the group."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._consumer is None:
            return
        owned = self.offsets.owned()
        dropped = sum(self.pipeline.assembler.discard(self.offsets.pending_traces(p)) for p in owned)
        writer = self.pipeline.writer
        deadline = time.monotonic() + STOP_FLUSH_TIMEOUT
        while writer.backlog and time.monotonic() < deadline and not writer.failing:
            await asyncio.sleep(0.05)
        self._commit(owned, asynchronous=False)
        self._consumer.close()  # leaves the group (its revoke, on this thread, commits nothing new)
        self._consumer = None
        log.info("kafka_receiver_stopped", dropped_open_traces=dropped, partitions=sorted(owned))

    def _error(self, event: str, error: str) -> None:
        """Log a client error, at most once per :data:`ERROR_LOG_INTERVAL` per kind (an outage repeats it)."""
        now = time.monotonic()
        key = f"{event}:{error[:80]}"
        if now - self._logged.get(key, -ERROR_LOG_INTERVAL) >= ERROR_LOG_INTERVAL:
            self._logged[key] = now
            log.warning(event, error=error, topic=self.config.topic)

    def _on_error(self, error: Any) -> None:
        self._error("kafka_client_error", str(error))
