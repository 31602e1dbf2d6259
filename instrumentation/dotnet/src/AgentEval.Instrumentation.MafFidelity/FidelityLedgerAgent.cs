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

    /// <summary>Wraps <paramref name="innerAgent"/>.</summary>
    public FidelityLedgerAgent(AIAgent innerAgent) : base(innerAgent)
    {
    }

    /// <inheritdoc />
    protected override Task<AgentResponse> RunCoreAsync(IEnumerable<ChatMessage> messages, AgentSession? session = null,
        AgentRunOptions? options = null, CancellationToken cancellationToken = default)
    {
        ArgumentNullException.ThrowIfNull(messages);
        return this.RunAndRecordAsync(messages, session, options, cancellationToken);
    }

    /// <inheritdoc />
    protected override IAsyncEnumerable<AgentResponseUpdate> RunCoreStreamingAsync(IEnumerable<ChatMessage> messages,
        AgentSession? session = null, AgentRunOptions? options = null, CancellationToken cancellationToken = default)
    {
        // Checked at the call, not on the stream's first MoveNextAsync.
        ArgumentNullException.ThrowIfNull(messages);
        return this.StreamAndRecordAsync(messages, session, options, cancellationToken);
    }

    private async Task<AgentResponse> RunAndRecordAsync(IEnumerable<ChatMessage> messages, AgentSession? session,
        AgentRunOptions? options, CancellationToken cancellationToken)
    {
        Invocation invocation = this.Begin();
        AgentResponse response = await this.InnerAgent.RunAsync(messages, session, options, cancellationToken).ConfigureAwait(false);
        this.Record(invocation, response, stream: false, closedEarly: false);
        return response;
    }

    private async IAsyncEnumerable<AgentResponseUpdate> StreamAndRecordAsync(IEnumerable<ChatMessage> messages,
        AgentSession? session, AgentRunOptions? options, [EnumeratorCancellation] CancellationToken cancellationToken)
    {
        Invocation invocation = this.Begin();
        // Nothing listens to the ledger: the updates pass through, none kept.
        List<AgentResponseUpdate>? updates = MafFidelity.Source.HasListeners() ? [] : null;
        if (updates is null)
        {
            MafFidelityEventSource.Log.LedgerSpanNotRecorded(this.LedgerName, MafFidelity.ActivitySourceName);
        }
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
                catch (Exception e)
                {
                    failed = true;
                    MafFidelityEventSource.Log.StreamFailed(this.LedgerName, e.GetType().FullName ?? e.GetType().Name);
                    throw;
                }
                updates?.Add(inner.Current);
                yield return inner.Current;
            }
            completed = true;
        }
        finally
        {
            await inner.DisposeAsync().ConfigureAwait(false);
            if (!failed && updates is not null)
            {
                this.Record(invocation, updates.ToAgentResponse(), stream: true, closedEarly: !completed);
            }
        }
    }

    /// <summary>
    /// What the ledger calls this agent: its name, else its id (as MAF's own agent span knows it), never
    /// its class: the collector tells agents apart by it.
    /// </summary>
    private string LedgerName => this.Name ?? this.InnerAgent.Name ?? this.Id;

    private Invocation Begin()
    {
        AgentSpanSources.EnsureListening();
        // An agent span already current (the decorator added inside UseOpenTelemetry) is this call's own.
        Activity? current = Activity.Current;
        var invocation = new Invocation(current, DateTimeOffset.UtcNow)
        {
            AgentSpan = current is not null && AgentSpanSources.Contains(current.Source.Name)
                && current.GetTagItem("gen_ai.agent.id") as string == this.Id ? current : null,
        };
        Current.Value = invocation;
        return invocation;
    }

    private void Record(Invocation invocation, AgentResponse response, bool stream, bool closedEarly)
    {
        // Inside a workflow the caller's span is its executor's (executor.process, WithOpenTelemetry()).
        string? executorId = invocation.Caller?.GetTagItem("executor.id") as string;
        if (invocation.AgentSpan is null && MafFidelity.Source.HasListeners())
        {
            MafFidelityEventSource.Log.AgentSpanNotFound(this.LedgerName, this.Id);
        }
        ActivityContext parent = (invocation.AgentSpan ?? invocation.Caller)?.Context ?? default;
        LedgerSpan.Record(response,
            // The span under the agent's own span is that agent's.
            new LedgerSpan.Origin(this.Name ?? this.InnerAgent.Name, this.Id, executorId, stream, closedEarly),
            parent, invocation.Started);
    }

    /// <summary>The first agent span that starts inside a call is that call's (a nested agent's own decorator starts a call of its own).</summary>
    internal static void AgentSpanStarted(Activity activity)
    {
        if (Current.Value is { AgentSpan: null } invocation)
        {
            invocation.AgentSpan = activity;
        }
    }

    private sealed class Invocation(Activity? caller, DateTimeOffset started)
    {
        public Activity? Caller { get; } = caller;
        public DateTimeOffset Started { get; } = started;
        public Activity? AgentSpan { get; set; }
    }
}

/// <summary>
/// The ActivitySources whose spans are MAF agent spans to the decorator: MAF's default and those named in
/// <see cref="MafFidelityInstrumentationOptions.AgentSourceNames"/>. Its listener sees them start and
/// samples nothing itself (the app's tracer provider decides); it is replaced when a name is added, so a
/// source created before is seen too.
/// </summary>
internal static class AgentSpanSources
{
    private static readonly object Gate = new();
    private static HashSet<string> s_names = new(StringComparer.Ordinal) { MafFidelity.AgentSourceName };
    private static ActivityListener? s_listener;

    internal static bool Contains(string name) => Volatile.Read(ref s_names).Contains(name);

    internal static void EnsureListening()
    {
        if (Volatile.Read(ref s_listener) is null)
        {
            Add([]);
        }
    }

    internal static void Add(IEnumerable<string> names)
    {
        lock (Gate)
        {
            var next = new HashSet<string>(s_names, StringComparer.Ordinal);
            int before = next.Count;
            next.UnionWith(names);
            if (next.Count == before && s_listener is not null)
            {
                return;
            }
            Volatile.Write(ref s_names, next);
            ActivityListener? old = s_listener;
            var listener = new ActivityListener
            {
                ShouldListenTo = source => Contains(source.Name),
                Sample = (ref ActivityCreationOptions<ActivityContext> _) => ActivitySamplingResult.None,
                ActivityStarted = FidelityLedgerAgent.AgentSpanStarted,
            };
            ActivitySource.AddActivityListener(listener);
            Volatile.Write(ref s_listener, listener);
            old?.Dispose();
        }
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
