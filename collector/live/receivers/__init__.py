"""The receivers (docs/design.md §3): one component per transport, which the server starts and stops.

- :mod:`.grpc_receiver`: OTLP/gRPC ``TraceService/Export``;
- :mod:`.http_receiver`: OTLP/HTTP ``POST /v1/traces``, its connections accepted by :mod:`.http_listener`;
- :mod:`.kafka_receiver`: OTLP protobuf trace requests from a Kafka topic, its offsets kept by
  :mod:`.kafka_offsets`.

They share :mod:`.decoding` (the decoder, and :class:`~.decoding.Undecodable`, the one error every
transport answers alike), :mod:`.otlp` (what the gRPC and HTTP receivers share), :mod:`.limits` and
:mod:`.telemetry` (what each transport counts and logs).

A receiver does no work when it is made: :meth:`Receiver.start` opens it, :meth:`Receiver.stop` closes
it. (This module imports nothing of theirs: the pipeline imports :mod:`.kafka_offsets`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Receiver(Protocol):
    async def start(self) -> None:
        """Open the transport and start receiving; when that fails, close what was opened and raise."""

    async def stop(self) -> None:
        """Stop receiving and close what :meth:`start` opened; nothing when it was not started."""


async def start_all(receivers: Sequence[Receiver]) -> None:
    """Start ``receivers`` in order; when one fails, stop those already started (the last first) and
    raise its error: a collector starts whole or not at all."""
    started: list[Receiver] = []
    for receiver in receivers:
        try:
            await receiver.start()
        except BaseException:
            await stop_all(started)
            raise
        started.append(receiver)


async def stop_all(receivers: Sequence[Receiver]) -> None:
    """Stop ``receivers``, the last started first."""
    for receiver in reversed(receivers):
        await receiver.stop()
