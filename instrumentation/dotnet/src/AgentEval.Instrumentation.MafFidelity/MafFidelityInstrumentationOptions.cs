namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// What <c>AddMafFidelityInstrumentation(options => ...)</c> adds beside <see cref="MafFidelity.AllSourceNames"/>.
/// </summary>
public sealed class MafFidelityInstrumentationOptions
{
    /// <summary>
    /// More ActivitySource names of MAF agent spans (<c>invoke_agent</c>), for an agent built with
    /// <c>UseOpenTelemetry(sourceName: "x")</c>: the tracer provider listens to each, and
    /// <c>UseFidelityLedger()</c> records under an agent span from any of them, as from
    /// <see cref="MafFidelity.AgentSourceName"/>.
    /// </summary>
    public IList<string> AgentSourceNames { get; } = new List<string>();

    /// <summary>
    /// More ActivitySource names of chat spans (<c>chat {model}</c>), for a chat client built with
    /// <c>UseOpenTelemetry(sourceName: "x")</c>: the tracer provider listens to each.
    /// </summary>
    public IList<string> ChatSourceNames { get; } = new List<string>();
}
