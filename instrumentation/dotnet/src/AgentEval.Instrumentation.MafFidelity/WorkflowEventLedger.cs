using System.Runtime.CompilerServices;
using Microsoft.Agents.AI.Workflows;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// The ledger over a workflow's event stream: every <see cref="AgentResponseEvent"/> (agents bound with
/// <c>AIAgentHostOptions.EmitAgentResponseEvents</c>, or builders' <c>EmitAgentResponseEvents</c>)
/// becomes a ledger span under the caller's current span, naming its <c>executor.id</c>; the collector
/// joins it to the workflow run beside it that has that executor.
/// </summary>
public static class WorkflowEventLedger
{
    /// <summary>Records one event's response (the seed's shape: a caller that records each event it sees).</summary>
    public static void RecordFidelityLedger(this AgentResponseEvent responseEvent)
    {
        ArgumentNullException.ThrowIfNull(responseEvent);
        LedgerSpan.Record(responseEvent.Response,
            new LedgerSpan.Origin(AgentName: null, AgentId: null, responseEvent.ExecutorId, Stream: null));
    }

    /// <summary>
    /// Passes <c>StreamingRun.WatchStreamAsync()</c>'s events through unchanged, recording each
    /// <see cref="AgentResponseEvent"/> as it goes by.
    /// </summary>
    public static async IAsyncEnumerable<WorkflowEvent> WithFidelityLedger(this IAsyncEnumerable<WorkflowEvent> events,
        [EnumeratorCancellation] CancellationToken cancellationToken = default)
    {
        ArgumentNullException.ThrowIfNull(events);
        await foreach (WorkflowEvent workflowEvent in events.WithCancellation(cancellationToken).ConfigureAwait(false))
        {
            (workflowEvent as AgentResponseEvent)?.RecordFidelityLedger();
            yield return workflowEvent;
        }
    }

    /// <summary>The same over <c>Run.NewEvents</c> (<c>InProcessExecution.RunAsync</c>).</summary>
    public static IEnumerable<WorkflowEvent> WithFidelityLedger(this IEnumerable<WorkflowEvent> events)
    {
        ArgumentNullException.ThrowIfNull(events);
        return Iterate(events);

        static IEnumerable<WorkflowEvent> Iterate(IEnumerable<WorkflowEvent> events)
        {
            foreach (WorkflowEvent workflowEvent in events)
            {
                (workflowEvent as AgentResponseEvent)?.RecordFidelityLedger();
                yield return workflowEvent;
            }
        }
    }
}
