"""Verdict spans, exported with the OpenTelemetry SDK into the *source* trace (docs/design.md §3 "Outputs").

``fidelity.run`` is a child of the workflow root span and each ``fidelity.executor {id}`` a child
of it, linked to the executor's spans, so a trace viewer shows the verdict beside the workflow.
Spans come from the :data:`~collector.decode.OWN_SCOPE` scope, which ingest ignores: pointing our
OTLP output at ourselves creates no feedback loop.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, StatusCode, TraceFlags

from collector.decode import OWN_SCOPE
from collector.model import ExecutorVerdict, RunVerdict, Status
from collector.render import fmt_score
from collector.serialize import MAX_ITEMS


def _ctx(trace_id: str, span_id: str) -> SpanContext:
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED))


def run_attributes(run: RunVerdict, run_id: str, max_items: int = MAX_ITEMS) -> dict:
    """The run span's attributes; its lists keep their first ``max_items`` entries, as the run
    document does (``fidelity.workflow_errors.more`` says how many more errors there were)."""
    attrs = {
        "fidelity.run_id": run_id,
        "fidelity.status": run.status.value,
        "fidelity.preset": run.preset,
        "fidelity.cost_tier": run.cost_tier,
        "fidelity.checked": run.checked,
        "fidelity.unchecked": run.unchecked,
        "fidelity.revision": run.revision,
        "fidelity.incomplete": run.incomplete,
        "fidelity.unattributed_chat_spans": run.unattributed_chat_spans,
    }
    if run.score is not None:  # PENDING has no score, not a zero
        attrs["fidelity.score"] = run.score
    if run.non_agent_executors:
        attrs["fidelity.non_agent_executors"] = list(run.non_agent_executors[:max_items])
    if run.workflow_errors:
        attrs["fidelity.workflow_errors"] = list(run.workflow_errors[:max_items])
        if len(run.workflow_errors) > max_items:
            attrs["fidelity.workflow_errors.more"] = len(run.workflow_errors) - max_items
    if run.subject:
        attrs["fidelity.subject"] = run.subject
    if run.maf_release:
        attrs["fidelity.maf.version"] = run.maf_release
    return attrs


def executor_attributes(e: ExecutorVerdict, run: RunVerdict, run_id: str) -> dict:
    ev = e.evidence
    attrs = {
        "fidelity.run_id": run_id,
        "fidelity.executor.id": e.executor_id,
        "fidelity.verdict": e.verdict.value,
        "fidelity.evidence.ledger_source": ev.ledger_source,
        "fidelity.evidence.ledger_missing": ev.ledger_missing,
        "fidelity.evidence.response_turns": ev.response_turns,
        "fidelity.evidence.request_turns": ev.request_turns,
        "fidelity.evidence.failed_turns": ev.failed_turns,
        "fidelity.revision": run.revision,
        "fidelity.incomplete": run.incomplete,
    }
    optional = {
        "fidelity.score": e.score,
        "fidelity.framework.tokens": ev.framework_tokens,
        "fidelity.truth.tokens": ev.truth_tokens,
        "fidelity.delta": ev.delta,
        "fidelity.direction": ev.direction,
        "fidelity.framework.finish_reason": ev.framework_finish,
        "fidelity.truth.finish_reason": ev.truth_finish,
        "fidelity.no_truth.reason": e.no_truth_reason.value if e.no_truth_reason else None,
        "fidelity.subject": run.subject,
    }
    attrs.update({k: v for k, v in optional.items() if v is not None})
    return attrs


class VerdictSpans:
    def __init__(self, exporter: SpanExporter, resource: Resource, max_items: int = MAX_ITEMS) -> None:
        #: Links per executor verdict span and entries per list attribute (``store.max_span_ids_per_unit``).
        self.max_items = max_items
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer(OWN_SCOPE)

    def emit(self, run: RunVerdict, run_id: str, anchor_span_id: str | None) -> None:
        parent = None
        if run.trace_id and anchor_span_id:
            parent = trace.set_span_in_context(NonRecordingSpan(_ctx(run.trace_id, anchor_span_id)))
        trace_id = run.trace_id
        with self.tracer.start_as_current_span("fidelity.run", context=parent,
                                               attributes=run_attributes(run, run_id, self.max_items),
                                               end_on_exit=True) as span:
            if run.status is Status.FAIL:
                span.set_status(StatusCode.ERROR, f"FAIL score {fmt_score(run.score)}")
            for e in run.executors:  # linked to its first executor spans (within the SDK's link limit)
                links = ([Link(_ctx(trace_id, sid)) for sid in e.evidence.executor_span_ids[:self.max_items]]
                         if trace_id else [])
                with self.tracer.start_as_current_span(f"fidelity.executor {e.executor_id}",
                                                       attributes=executor_attributes(e, run, run_id), links=links):
                    pass

    def shutdown(self) -> None:
        self.provider.shutdown()


def otlp_span_exporter(endpoint: str, protocol: str, insecure: bool) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
