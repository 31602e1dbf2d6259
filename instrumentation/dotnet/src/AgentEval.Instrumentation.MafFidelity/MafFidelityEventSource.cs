using System.Diagnostics.Tracing;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// The package's self-diagnostics, "AgentEval-Instrumentation-MafFidelity": what the ledger did not record,
/// and why (read it with <c>dotnet-trace collect --providers AgentEval-Instrumentation-MafFidelity</c>, or
/// an in-process <see cref="EventListener"/>). Never message text.
/// </summary>
[EventSource(Name = EventSourceName)]
internal sealed class MafFidelityEventSource : EventSource
{
    internal const string EventSourceName = "AgentEval-Instrumentation-MafFidelity";

    public static readonly MafFidelityEventSource Log = new();

    [Event(1, Level = EventLevel.Warning, Message = "Ledger span of '{0}' not recorded: nothing listens to the ActivitySource '{1}' (AddMafFidelityInstrumentation() on the tracer provider adds it).")]
    public void LedgerSpanNotRecorded(string agent, string activitySource)
    {
        if (this.IsEnabled(EventLevel.Warning, EventKeywords.All))
        {
            this.WriteEvent(1, agent, activitySource);
        }
    }

    [Event(2, Level = EventLevel.Warning, Message = "The streamed run of agent '{0}' failed ({1}): no ledger span recorded for it.")]
    public void StreamFailed(string agent, string exceptionType)
    {
        if (this.IsEnabled(EventLevel.Warning, EventKeywords.All))
        {
            this.WriteEvent(2, agent, exceptionType);
        }
    }

    [Event(3, Level = EventLevel.Warning, Message = "No invoke_agent span found for a call of agent '{0}' (id {1}): its ledger span is recorded under the caller's span. Add UseOpenTelemetry() after UseFidelityLedger(), and name its sourceName in MafFidelityInstrumentationOptions.AgentSourceNames if it is not the default.")]
    public void AgentSpanNotFound(string agent, string agentId)
    {
        if (this.IsEnabled(EventLevel.Warning, EventKeywords.All))
        {
            this.WriteEvent(3, agent, agentId);
        }
    }

    [Event(4, Level = EventLevel.Warning, Message = "Workflow session '{0}' began before the package listened to MAF's workflow spans: its ledger spans carry no identity of their run. Call AddMafFidelityInstrumentation() before the first run starts.")]
    public void SessionNotFollowed(string sessionId)
    {
        if (this.IsEnabled(EventLevel.Warning, EventKeywords.All))
        {
            this.WriteEvent(4, sessionId);
        }
    }

    [Event(5, Level = EventLevel.Warning, Message = "No executor.process span found for the AgentResponseEvent of executor '{0}' in session '{1}': its ledger span is recorded under the caller's span. The workflow needs WithOpenTelemetry(), and every event of the run read through WithFidelityLedger(run).")]
    public void ExecutorSpanNotFound(string executorId, string sessionId)
    {
        if (this.IsEnabled(EventLevel.Warning, EventKeywords.All))
        {
            this.WriteEvent(5, executorId, sessionId);
        }
    }
}
