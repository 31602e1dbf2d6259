using System.Diagnostics;
using System.Runtime.CompilerServices;
using Microsoft.Agents.AI.Workflows;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// The ledger over a workflow's event stream: every <see cref="AgentResponseEvent"/> (agents bound with
/// <c>AIAgentHostOptions.EmitAgentResponseEvents</c>, or builders' <c>EmitAgentResponseEvents</c>)
/// becomes a ledger span naming its <c>executor.id</c>. Given the run, each span is recorded under the
/// <c>executor.process</c> span of the invocation that produced it, so the collector joins it to that run
/// (that turn, of a session of several) by identity; without the run, under the caller's current span,
/// where the collector joins it only to the one run beside it that has that executor.
/// </summary>
public static class WorkflowEventLedger
{
    /// <summary>
    /// Records one event's response under the caller's current span: its run cannot be told from the
    /// event alone, so where several runs under that span ran its executor the collector compares none
    /// of them (NoTruth <c>ledger_unjoined</c>). Prefer <see cref="WithFidelityLedger(IAsyncEnumerable{WorkflowEvent}, StreamingRun, CancellationToken)"/>.
    /// </summary>
    public static void RecordFidelityLedger(this AgentResponseEvent responseEvent)
    {
        ArgumentNullException.ThrowIfNull(responseEvent);
        Record(responseEvent, sessionId: null, parent: default);
    }

    /// <summary>
    /// Passes <c>run.WatchStreamAsync()</c>'s events through unchanged, recording each
    /// <see cref="AgentResponseEvent"/> in the run that produced it:
    /// <c>await foreach (WorkflowEvent e in run.WatchStreamAsync().WithFidelityLedger(run))</c>. Read every
    /// turn's events through it; the workflow needs <c>WithOpenTelemetry()</c>.
    /// </summary>
    public static IAsyncEnumerable<WorkflowEvent> WithFidelityLedger(this IAsyncEnumerable<WorkflowEvent> events,
        StreamingRun run, CancellationToken cancellationToken = default)
    {
        ArgumentNullException.ThrowIfNull(events);
        ArgumentNullException.ThrowIfNull(run);
        return Read(events, run.SessionId, cancellationToken);
    }

    /// <summary>The same over <c>Run.NewEvents</c> (<c>InProcessExecution.RunAsync</c>): <c>run.NewEvents.WithFidelityLedger(run)</c>.</summary>
    public static IEnumerable<WorkflowEvent> WithFidelityLedger(this IEnumerable<WorkflowEvent> events, Run run)
    {
        ArgumentNullException.ThrowIfNull(events);
        ArgumentNullException.ThrowIfNull(run);
        return Read(events, run.SessionId);
    }

    /// <summary>
    /// Passes <c>StreamingRun.WatchStreamAsync()</c>'s events through unchanged, recording each
    /// <see cref="AgentResponseEvent"/> under the caller's current span, as <see cref="RecordFidelityLedger"/>
    /// does: runs under one caller span that share an executor are not told apart. Prefer the overload
    /// given the run.
    /// </summary>
    public static IAsyncEnumerable<WorkflowEvent> WithFidelityLedger(this IAsyncEnumerable<WorkflowEvent> events,
        CancellationToken cancellationToken = default)
    {
        ArgumentNullException.ThrowIfNull(events);
        return Read(events, sessionId: null, cancellationToken);
    }

    /// <summary>The same over <c>Run.NewEvents</c>; prefer the overload given the run.</summary>
    public static IEnumerable<WorkflowEvent> WithFidelityLedger(this IEnumerable<WorkflowEvent> events)
    {
        ArgumentNullException.ThrowIfNull(events);
        return Read(events, sessionId: null);
    }

    private static async IAsyncEnumerable<WorkflowEvent> Read(IAsyncEnumerable<WorkflowEvent> events, string? sessionId,
        [EnumeratorCancellation] CancellationToken cancellationToken)
    {
        await foreach (WorkflowEvent workflowEvent in events.WithCancellation(cancellationToken).ConfigureAwait(false))
        {
            See(workflowEvent, sessionId);
            yield return workflowEvent;
        }
    }

    private static IEnumerable<WorkflowEvent> Read(IEnumerable<WorkflowEvent> events, string? sessionId)
    {
        foreach (WorkflowEvent workflowEvent in events)
        {
            See(workflowEvent, sessionId);
            yield return workflowEvent;
        }
    }

    private static void See(WorkflowEvent workflowEvent, string? sessionId)
    {
        ActivityContext producer = sessionId is null ? default : RunSpans.Read(sessionId, workflowEvent);
        if (workflowEvent is AgentResponseEvent responseEvent)
        {
            Record(responseEvent, sessionId, producer);
        }
    }

    private static void Record(AgentResponseEvent responseEvent, string? sessionId, ActivityContext parent) =>
        LedgerSpan.Record(responseEvent.Response,
            new LedgerSpan.Origin(AgentName: null, AgentId: null, responseEvent.ExecutorId, Stream: null, SessionId: sessionId),
            parent);
}
