using System.Diagnostics;
using Microsoft.Agents.AI;
using Microsoft.Extensions.AI;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// Writes one AgentResponse as a ledger span: usage (with its cached and reasoning parts) and finish
/// reason, never message text. The attributes are the Python instrumentation's, so the collector
/// reads both runtimes alike (docs/dotnet.md).
/// </summary>
internal static class LedgerSpan
{
    internal const string LedgerSourceAttribute = "fidelity.ledger.source";
    internal const string LedgerSource = "AgentResponseEvent";

    /// <summary>What one ledger span says beside the response: who answered, and where.</summary>
    internal readonly record struct Origin(string? AgentName, string? AgentId, string? ExecutorId, bool? Stream,
        bool ClosedEarly = false, string? SessionId = null);

    /// <summary>Records <paramref name="response"/> under <paramref name="parent"/> (the current span when default).</summary>
    internal static void Record(AgentResponse response, Origin origin, ActivityContext parent = default,
        DateTimeOffset startTime = default)
    {
        string name = origin.AgentName ?? origin.AgentId ?? origin.ExecutorId ?? "agent";
        if (!MafFidelity.Source.HasListeners())
        {
            MafFidelityEventSource.Log.LedgerSpanNotRecorded(name, MafFidelity.ActivitySourceName);
            return;
        }
        var tags = new ActivityTagsCollection
        {
            [LedgerSourceAttribute] = LedgerSource,
            ["fidelity.maf.version"] = MafFidelity.MafRelease,
            ["fidelity.instrumentation.version"] = MafFidelity.Version,
            ["fidelity.instrumentation.status"] = "active",
        };
        if (origin.AgentName is not null)
        {
            // Recorded where the agent ran: the collector attributes it to this agent. An unnamed agent
            // is known by its id (below); a workflow event names its executor instead and joins that
            // executor's run.
            tags["fidelity.agent.name"] = origin.AgentName;
            tags["gen_ai.agent.name"] = origin.AgentName;
        }
        if (origin.AgentId is not null)
        {
            tags["gen_ai.agent.id"] = origin.AgentId;
        }
        if (origin.ExecutorId is not null)
        {
            tags["executor.id"] = origin.ExecutorId;
        }
        if (origin.SessionId is not null)
        {
            // The run's session, as MAF's workflow spans carry it (shown beside the run; the parent joins it).
            tags["session.id"] = origin.SessionId;
        }
        if (origin.Stream is bool stream)
        {
            tags["fidelity.stream"] = stream;
        }
        if (origin.ClosedEarly)
        {
            tags["fidelity.stream.closed_early"] = true;
        }
        AddUsage(tags, response.Usage);
        if (response.FinishReason is ChatFinishReason finish)
        {
            tags["gen_ai.response.finish_reasons"] = new[] { finish.Value };
        }

        using Activity? activity = MafFidelity.Source.StartActivity(
            $"{MafFidelity.SpanPrefix} {name}", ActivityKind.Internal, parent, tags,
            startTime: startTime == default ? DateTimeOffset.UtcNow : startTime);
    }

    private static void AddUsage(ActivityTagsCollection tags, UsageDetails? usage)
    {
        if (usage is null)
        {
            return;
        }
        (string Key, long? Value)[] counts =
        [
            ("gen_ai.usage.input_tokens", usage.InputTokenCount),
            ("gen_ai.usage.output_tokens", usage.OutputTokenCount),
            ("gen_ai.usage.total_tokens", usage.TotalTokenCount),
            // Parts of the counts above (GenAI conventions), never added on top.
            ("gen_ai.usage.cache_read.input_tokens", usage.CachedInputTokenCount),
            ("gen_ai.usage.reasoning.output_tokens", usage.ReasoningTokenCount),
        ];
        foreach ((string key, long? value) in counts)
        {
            if (value is long count)
            {
                tags[key] = count;
            }
        }
    }
}
