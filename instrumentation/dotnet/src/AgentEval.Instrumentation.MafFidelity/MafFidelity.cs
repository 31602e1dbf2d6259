using System.Diagnostics;
using System.Reflection;
using Microsoft.Agents.AI.Workflows;
using OpenTelemetry.Trace;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// The names a user adds to a <see cref="TracerProviderBuilder"/> so that a MAF .NET app sends what a
/// workflow fidelity collector reconciles: the framework's ledger (this package's spans) and MAF's own
/// workflow, agent and chat spans.
/// </summary>
public static class MafFidelity
{
    /// <summary>The <see cref="ActivitySource"/> of this package's ledger spans.</summary>
    public const string ActivitySourceName = "AgentEval.Instrumentation.MafFidelity";

    /// <summary>MAF's workflow spans (<c>workflow.session</c>, <c>workflow_invoke</c>, <c>executor.process</c>): on with <c>WorkflowBuilder.WithOpenTelemetry()</c>.</summary>
    public const string WorkflowSourceName = "Microsoft.Agents.AI.Workflows";

    /// <summary>MAF's agent spans (<c>invoke_agent</c>): on with <c>AIAgentBuilder.UseOpenTelemetry()</c>.</summary>
    public const string AgentSourceName = "Experimental.Microsoft.Agents.AI";

    /// <summary>Microsoft.Extensions.AI's chat spans (<c>chat {model}</c>): on with <c>ChatClientBuilder.UseOpenTelemetry()</c>.</summary>
    public const string ChatSourceName = "Experimental.Microsoft.Extensions.AI";

    /// <summary>
    /// Every source above, read-only, for <c>AddSource(MafFidelity.AllSourceNames)</c> (it converts to a
    /// <see cref="string"/> array of its own).
    /// </summary>
    public static MafFidelitySourceNames AllSourceNames { get; } =
        new([ActivitySourceName, WorkflowSourceName, AgentSourceName, ChatSourceName]);

    /// <summary>The span name prefix of a ledger span: <c>agent_response {agent}</c>.</summary>
    public const string SpanPrefix = "agent_response";

    /// <summary>This package's version.</summary>
    public static string Version { get; } = InformationalVersion(typeof(MafFidelity).Assembly);

    /// <summary>
    /// The MAF .NET release found at run time, as the collector shows it (<c>dotnet-1.28.0</c>: the
    /// runtime and Microsoft.Agents.AI.Workflows' version), so a run says which MAF it came from.
    /// </summary>
    public static string MafRelease { get; } = "dotnet-" + InformationalVersion(typeof(AgentResponseEvent).Assembly);

    internal static readonly ActivitySource Source = new(ActivitySourceName, Version);

    /// <summary>The package's first use follows MAF's workflow spans from then on (see <see cref="RunSpans"/>).</summary>
    static MafFidelity() => RunSpans.EnsureListening();

    private static string InformationalVersion(Assembly assembly)
    {
        string? version = assembly.GetCustomAttribute<AssemblyInformationalVersionAttribute>()?.InformationalVersion
            ?? assembly.GetName().Version?.ToString();
        // "1.28.0+<commit>": the build metadata names no release.
        return version is null ? "unknown" : version.Split('+')[0];
    }
}
