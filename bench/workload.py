"""Realistic MAF-shaped OTLP payloads, pre-encoded, plus helpers shared by the bench scripts.

A trace: a ``workflow.run`` root, 3-10 ``executor.process`` spans, under each an ``invoke_agent``
with 1-5 ``chat`` spans; about ten attributes a span (ids, usage, finish reasons, model names).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

AGENTEVAL = str(Path(sys.executable).parent / "agenteval")


def _kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _span(rng: random.Random, trace_id: bytes, parent: bytes, name: str, start: int, attrs: dict) -> Span:
    return Span(trace_id=trace_id, span_id=rng.randbytes(8), parent_span_id=parent, name=name,
                kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=start, end_time_unix_nano=start + 1000,
                attributes=[_kv(k, v) for k, v in attrs.items()])


def trace_spans(rng: random.Random, executors: int | None = None, chats: int | None = None) -> list[Span]:
    """One workflow trace, children before parents (the order exporters send them in)."""
    tid = rng.randbytes(16)
    t = 1_700_000_000_000_000_000
    root = _span(rng, tid, b"", "workflow.run", t, {"workflow.id": "wf", "workflow.name": "bench",
                                                     "workflow.definition.hash": "abc123"})
    out: list[Span] = []
    for e in range(executors or rng.randint(3, 10)):
        eid = f"agent-{e}"
        ex = _span(rng, tid, root.span_id, f"executor.process {eid}", t + e * 10,
                   {"executor.id": eid, "executor.type": "AgentExecutor", "message.type": "MessageType.STANDARD",
                    "message.payload_type": "WorkflowMessage"})
        total_in = total_out = 0
        agent = _span(rng, tid, ex.span_id, f"invoke_agent {eid}", t + e * 10 + 1, {})
        for c in range(chats or rng.randint(1, 5)):
            i, o = rng.randint(50, 2000), rng.randint(10, 800)
            total_in, total_out = total_in + i, total_out + o
            out.append(_span(rng, tid, agent.span_id, "chat gpt-4o", t + e * 10 + 2 + c, {
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o", "gen_ai.provider.name": "openai",
                "server.address": "api.example", "gen_ai.request.choice.count": 1,
                "gen_ai.usage.input_tokens": i, "gen_ai.usage.output_tokens": o,
                "gen_ai.response.finish_reasons": '["stop"]', "gen_ai.response.id": f"resp-{c}",
                "gen_ai.response.model": "gpt-4o-2024"}))
        agent.attributes.extend([_kv(k, v) for k, v in {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": eid, "gen_ai.agent.id": f"id-{eid}",
            "gen_ai.request.model": "gpt-4o", "gen_ai.provider.name": "microsoft.agent_framework",
            "gen_ai.usage.input_tokens": total_in, "gen_ai.usage.output_tokens": total_out,
            "gen_ai.response.finish_reasons": '["stop"]', "gen_ai.request.choice.count": 1}.items()])
        # The framework's own report, as the MAF instrumentation records it under the agent span.
        out.append(_span(rng, tid, agent.span_id, f"agent_response {eid}", t + e * 10 + 9, {
            "fidelity.ledger.source": "AgentResponseEvent", "gen_ai.agent.name": eid, "gen_ai.agent.id": f"id-{eid}",
            "fidelity.stream": False, "gen_ai.usage.input_tokens": total_in, "gen_ai.usage.output_tokens": total_out,
            "gen_ai.response.finish_reasons": ["stop"]}))
        out += [agent, ex]
    out.append(root)
    return out


def encode(traces: list[list[Span]], spans_per_request: int = 512) -> list[bytes]:
    """Pack whole traces into requests of about ``spans_per_request`` spans, serialized."""
    bodies, current, count = [], ExportTraceServiceRequest(), 0

    def scope():
        rs = current.resource_spans.add()
        rs.resource.attributes.append(_kv("service.name", "bench-app"))
        ss = rs.scope_spans.add()
        ss.scope.name = "agent_framework"
        return ss

    ss = scope()
    for spans in traces:
        ss.spans.extend(spans)
        count += len(spans)
        if count >= spans_per_request:
            bodies.append(current.SerializeToString())
            current, count = ExportTraceServiceRequest(), 0
            ss = scope()
    if count:
        bodies.append(current.SerializeToString())
    return bodies


def walk_limit(bodies: list[bytes]) -> int:
    """What any consumer must do: parse, and touch every span's ids, parent, name and attributes."""
    n = 0
    for body in bodies:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    _ = (span.trace_id, span.span_id, span.parent_span_id, span.name)
                    for kv in span.attributes:
                        _ = (kv.key, kv.value.WhichOneof("value"))
                    n += 1
    return n


class Collector:
    """The collector as a subprocess on ports chosen at run time."""

    def __init__(self, assembly: dict | None = None, code: str | None = None, journal: bool = True) -> None:
        """``code``: run the collector package from that source tree (e.g. a worktree of another
        commit) instead of the installed one, to compare commits side by side on one payload."""
        self.dir = Path(tempfile.mkdtemp(prefix="agenteval-bench-"))
        self.store = self.dir / "runs.db"
        cfg = {"receivers": {"grpc": {"endpoint": "127.0.0.1:0", "max_message_bytes": 64 << 20},
                             "http": {"endpoint": "127.0.0.1:0", "max_body_bytes": 64 << 20}},
               "assembly": {"quiet_period": 0.2, **(assembly or {})},
               "store": {"url": str(self.store)},
               **({} if journal else {"journal": {"enabled": False}}),
               "exporters": {"prometheus": {"endpoint": "127.0.0.1:0"}},
               "logging": {"level": "info"}}
        (self.dir / "c.yaml").write_text(yaml.safe_dump(cfg))
        self.log = (self.dir / "log").open("w+")
        self.proc = subprocess.Popen([AGENTEVAL, "collector", "serve", "--config", str(self.dir / "c.yaml")],
                                     stdout=subprocess.DEVNULL, stderr=self.log,
                                     env={**os.environ, **({"PYTHONPATH": code} if code else {})})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in (self.dir / "log").read_text().splitlines():
                if '"collector_listening"' in line:
                    event = json.loads(line)
                    self.grpc, self.http, self.prometheus = event["grpc"], event["http"], event["prometheus"]
                    return
            time.sleep(0.05)
        raise RuntimeError("collector did not start")

    def stored(self) -> int:
        try:
            con = sqlite3.connect(self.store)
            try:
                return con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error:
            return 0

    def wait_stored(self, n: int, timeout: float = 600) -> float:
        deadline = time.monotonic() + timeout
        while self.stored() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.stored()} of {n} runs stored")
            time.sleep(0.02)
        return time.monotonic()

    def rss_kib(self) -> tuple[int, int]:
        """(current RSS, peak RSS) in KiB from /proc."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
