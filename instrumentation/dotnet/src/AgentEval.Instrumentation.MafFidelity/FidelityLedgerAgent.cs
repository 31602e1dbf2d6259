using System.Diagnostics;
using System.Runtime.CompilerServices;
using Microsoft.Agents.AI;
using Microsoft.Extensions.AI;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// The ledger as an agent decorator, for agents run outside a workflow's events (a direct call, an
/// agent used as a tool, <c>workflow.AsAIAgent()</c>'s inner agents, builders that emit no
/// <see cref="Microsoft.Agents.AI.Workflows.AgentResponseEvent"/>). It records the AgentResponse its
/// caller receives, once per call, in the agent's own span context: under the <c>invoke_agent</c> span
/// that <c>UseOpenTelemetry()</c> starts inside it, else under the caller's span. A call that throws
/// records nothing; a stream records when consumed, or what it had when its consumer stopped early.
/// </summary>
/// <remarks>Add it outermost (first in the builder), so what it records is what the caller got,
/// after every other middleware: <c>agent.AsBuilder().UseFidelityLedger().UseOpenTelemetry().Build()</c>.</remarks>
public sealed class FidelityLedgerAgent : DelegatingAIAgent
{
    /// <summary>The call in progress in this async flow, to learn the <c>invoke_agent</c> span started inside it.</summary>
    private static readonly AsyncLocal<Invocation?> Current = new();

    /// <summary>Sees MAF's agent spans start; samples nothing itself (the app's tracer provider decides).</summary>
    private static readonly ActivityListener AgentSpans = Listen();

    /// <summary>Wraps <paramref name="innerAgent"/>.</summary>
    public FidelityLedgerAgent(AIAgent innerAgent) : base(innerAgent)
    {
    }

    /// <inheritdoc />
    protected override async Task<AgentResponse> RunCoreAsync(IEnumerable<ChatMessage> messages, AgentSession? session = null,
        AgentRunOptions? options = null, CancellationToken cancellationToken = default)
    {
        Invocation invocation = this.Begin();
        AgentResponse response = await this.InnerAgent.RunAsync(messages, session, options, cancellationToken).ConfigureAwait(false);
        this.Record(invocation, response, stream: false, closedEarly: false);
        return response;
    }

    /// <inheritdoc />
    protected override async IAsyncEnumerable<AgentResponseUpdate> RunCoreStreamingAsync(IEnumerable<ChatMessage> messages,
        AgentSession? session = null, AgentRunOptions? options = null,
        [EnumeratorCancellation] CancellationToken cancellationToken = default)
    {
        Invocation invocation = this.Begin();
        List<AgentResponseUpdate> updates = [];
        bool completed = false, failed = false;
        IAsyncEnumerator<AgentResponseUpdate> inner = this.InnerAgent
            .RunStreamingAsync(messages, session, options, cancellationToken).GetAsyncEnumerator(cancellationToken);
        try
        {
            while (true)
            {
                try
                {
                    if (!await inner.MoveNextAsync().ConfigureAwait(false))
                    {
                        break;
                    }
                }
                catch
                {
                    failed = true;
                    throw;
                }
                updates.Add(inner.Current);
                yield return inner.Current;
            }
            completed = true;
        }
        finally
        {
            await inner.DisposeAsync().ConfigureAwait(false);
            if (!failed)
            {
                this.Record(invocation, updates.ToAgentResponse(), stream: true, closedEarly: !completed);
            }
        }
    }

    private Invocation Begin()
    {
        _ = AgentSpans;
        // An agent span already current (the decorator added inside UseOpenTelemetry) is this call's own.
        Activity? current = Activity.Current;
        var invocation = new Invocation(current, DateTimeOffset.UtcNow)
        {
            AgentSpan = current?.Source.Name == MafFidelity.AgentSourceName
                && current.GetTagItem("gen_ai.agent.id") as string == this.Id ? current : null,
        };
        Current.Value = invocation;
        return invocation;
    }

    private void Record(Invocation invocation, AgentResponse response, bool stream, bool closedEarly)
    {
        // Inside a workflow the caller's span is its executor's (executor.process, WithOpenTelemetry()).
        string? executorId = invocation.Caller?.GetTagItem("executor.id") as string;
        ActivityContext parent = (invocation.AgentSpan ?? invocation.Caller)?.Context ?? default;
        LedgerSpan.Record(response,
            // An agent without a name is known by its id (as MAF's own agent span knows it), never by its class:
            // the collector tells agents apart by it, and the span under the agent's own span is that agent's.
            new LedgerSpan.Origin(this.Name ?? this.InnerAgent.Name, this.Id, executorId, stream, closedEarly),
            parent, invocation.Started);
    }

    private static ActivityListener Listen()
    {
        var listener = new ActivityListener
        {
            ShouldListenTo = source => source.Name == MafFidelity.AgentSourceName,
            Sample = (ref ActivityCreationOptions<ActivityContext> _) => ActivitySamplingResult.None,
            // The first agent span that starts inside a call is that call's (a nested agent's own
            // decorator starts a call of its own).
            ActivityStarted = activity =>
            {
                if (Current.Value is { AgentSpan: null } invocation)
                {
                    invocation.AgentSpan = activity;
                }
            },
        };
        ActivitySource.AddActivityListener(listener);
        return listener;
    }

    private sealed class Invocation(Activity? caller, DateTimeOffset started)
    {
        public Activity? Caller { get; } = caller;
        public DateTimeOffset Started { get; } = started;
        public Activity? AgentSpan { get; set; }
    }
}

/// <summary>The decorator as one more <c>Use...</c> in an agent's builder chain.</summary>
public static class FidelityLedgerAgentBuilderExtensions
{
    /// <summary>
    /// Records every AgentResponse this agent returns as a ledger span. Add it first (outermost):
    /// <c>agent.AsBuilder().UseFidelityLedger().UseOpenTelemetry().Build()</c>.
    /// </summary>
    public static AIAgentBuilder UseFidelityLedger(this AIAgentBuilder builder)
    {
        ArgumentNullException.ThrowIfNull(builder);
        return builder.Use(inner => new FidelityLedgerAgent(inner));
    }
}
