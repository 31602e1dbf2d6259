using AgentEval.Instrumentation.MafFidelity;

namespace OpenTelemetry.Trace;

/// <summary>The ledger's switch on a tracer provider, as OpenTelemetry's instrumentation packages name theirs.</summary>
public static class MafFidelityTracerProviderBuilderExtensions
{
    /// <summary>
    /// Adds this package's ledger spans and MAF's workflow, agent and chat sources
    /// (<see cref="MafFidelity.AllSourceNames"/>) to the tracer provider: the one switch for the ledger's
    /// side. MAF's own spans still need their switches (<c>WithOpenTelemetry()</c> on the workflow,
    /// <c>UseOpenTelemetry()</c> on agents and chat clients).
    /// </summary>
    public static TracerProviderBuilder AddMafFidelityInstrumentation(this TracerProviderBuilder builder) =>
        AddMafFidelityInstrumentation(builder, configure: null);

    /// <summary>
    /// The same, with more agent and chat sources (<see cref="MafFidelityInstrumentationOptions"/>): for an
    /// app whose agents or chat clients call <c>UseOpenTelemetry(sourceName: "x")</c>.
    /// </summary>
    public static TracerProviderBuilder AddMafFidelityInstrumentation(this TracerProviderBuilder builder,
        Action<MafFidelityInstrumentationOptions>? configure)
    {
        ArgumentNullException.ThrowIfNull(builder);
        var options = new MafFidelityInstrumentationOptions();
        configure?.Invoke(options);
        string[] agentSources = Names(options.AgentSourceNames, nameof(options.AgentSourceNames));
        string[] chatSources = Names(options.ChatSourceNames, nameof(options.ChatSourceNames));

        // From here on MAF's workflow spans are followed (a run begun earlier cannot be), and agent spans
        // of the extra sources are the decorator's.
        RunSpans.EnsureListening();
        AgentSpanSources.Add(agentSources);

        builder.AddSource(MafFidelity.AllSourceNames);
        string[] extra = [.. agentSources, .. chatSources];
        return extra.Length == 0 ? builder : builder.AddSource(extra);
    }

    private static string[] Names(IList<string> names, string option)
    {
        foreach (string name in names)
        {
            if (string.IsNullOrWhiteSpace(name))
            {
                throw new ArgumentException($"{option} holds a null or blank ActivitySource name.", "configure");
            }
        }
        return [.. names.Distinct(StringComparer.Ordinal)];
    }
}
