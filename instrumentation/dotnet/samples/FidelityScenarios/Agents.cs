using System.Runtime.CompilerServices;
using Microsoft.Agents.AI;
using Microsoft.Extensions.AI;

namespace FidelityScenarios;

/// <summary>What an agent middleware does to the AgentResponse on its way to the caller.</summary>
public enum Report
{
    /// <summary>Passes it on as it is.</summary>
    Honest,
    /// <summary>Halves every token count (an under-reporting middleware).</summary>
    HalveUsage,
    /// <summary>Drops the finish reason (a suppressed content_filter).</summary>
    SuppressFinish,
    /// <summary>Keeps only the last model call's usage (a tool loop's books kept wrong).</summary>
    LastCallOnly,
    /// <summary>Leaves the cached part out of the input tokens (a ledger that bills cache hits as free).</summary>
    DropCached,
    /// <summary>Doubles every token count (an over-report: Agree by the verdict table, shown as "over").</summary>
    DoubleUsage,
}

/// <summary>One agent of a scenario: its name, the model calls its script answers, and its middleware.</summary>
public sealed record AgentPlan(string Name, ScriptedCall[] Calls, Report Report = Report.Honest)
{
    /// <summary>
    /// The agent is created without a name, as most of MAF's samples create theirs; <see cref="Name"/>
    /// is then the unit name the collector must give it (<c>unnamed-agent-2</c>, <c>Drafter/unnamed-agent-1</c>).
    /// </summary>
    public bool Unnamed { get; init; }

    /// <summary>What the chat boundary saw: every answered call's tokens.</summary>
    public int TruthTokens => this.Calls.Where(c => !c.Fails).Sum(c => c.Total);

    /// <summary>The last answered call's finish reason.</summary>
    public string? TruthFinish => this.Calls.LastOrDefault(c => !c.Fails)?.Finish;

    /// <summary>What the framework's AgentResponse says after the middleware.</summary>
    public int FrameworkTokens => this.Report switch
    {
        Report.HalveUsage => this.Answered.Sum(c => c.InputTokens) / 2 + this.Answered.Sum(c => c.OutputTokens) / 2,
        Report.LastCallOnly => this.Calls.Last(c => !c.Fails).Total,
        Report.DropCached => this.TruthTokens - this.Answered.Sum(c => c.CachedInputTokens ?? 0),
        Report.DoubleUsage => 2 * this.TruthTokens,
        _ => this.TruthTokens,
    };

    private IEnumerable<ScriptedCall> Answered => this.Calls.Where(c => !c.Fails);

    /// <summary>A part of the truth's counts as the collector shows it: its sum, null where no call reported it.</summary>
    private long? Part(Func<ScriptedCall, int?> part) =>
        this.Answered.Any(c => part(c) is not null) ? this.Answered.Sum(c => part(c) ?? 0) : null;

    public string? FrameworkFinish => this.Report == Report.SuppressFinish ? null : this.TruthFinish;

    /// <summary>
    /// What the collector must conclude of this agent. <paramref name="afterMiddleware"/>: the framework's
    /// side is the response the caller got (the ledger package); else MAF's agent span's, from inside
    /// the middleware, which is the truth. An agent whose every call failed reported nothing:
    /// NoTruth ledger_missing, never the Path-2 gap.
    /// </summary>
    public UnitExpectation Expected(bool afterMiddleware, bool unjoined = false)
    {
        if (this.Calls.All(c => c.Fails))
        {
            return new UnitExpectation("NoTruth", 0, null, null, null, "ledger_missing");
        }
        long? cached = this.Part(c => c.CachedInputTokens), reasoning = this.Part(c => c.ReasoningTokens);
        if (unjoined)
        {
            // Its ledger span could not be joined to this run: nothing compared, MAF's agent span shown.
            return new UnitExpectation("NoTruth", this.TruthTokens, this.TruthTokens, this.TruthFinish, this.TruthFinish,
                "ledger_unjoined", null, cached, reasoning);
        }
        int framework = afterMiddleware ? this.FrameworkTokens : this.TruthTokens;
        string? finish = afterMiddleware ? this.FrameworkFinish : this.TruthFinish;
        bool tokens = framework < this.TruthTokens * 0.98;
        bool finishDiffers = this.TruthFinish is not null
            && !string.Equals(finish, this.TruthFinish, StringComparison.OrdinalIgnoreCase);
        string verdict = (tokens, finishDiffers) switch
        {
            (true, true) => "Both",
            (true, false) => "TokenMismatch",
            (false, true) => "FinishMismatch",
            _ => "Agree",
        };
        string direction = framework < this.TruthTokens ? "under" : framework > this.TruthTokens ? "over" : "equal";
        return new UnitExpectation(verdict, this.TruthTokens, framework, this.TruthFinish, finish, null, direction, cached,
            reasoning);
    }
}

/// <summary>One unit's expected verdict and evidence, as the collector's run document names them.</summary>
public sealed record UnitExpectation(string Verdict, int TruthTokens, int? FrameworkTokens, string? TruthFinish,
    string? FrameworkFinish, string? NoTruthReason, string? Direction = null, long? TruthCacheReadTokens = null,
    long? TruthReasoningTokens = null);

/// <summary>
/// An agent middleware that changes the response as its plan's <see cref="Report"/> says, plain and
/// streamed; given several plans (one agent's turns, one run each), the n-th call follows the n-th.
/// </summary>
public sealed class MisreportingAgent(AIAgent inner, params AgentPlan[] plans) : DelegatingAIAgent(inner)
{
    private int _calls;

    protected override async Task<AgentResponse> RunCoreAsync(IEnumerable<ChatMessage> messages, AgentSession? session = null,
        AgentRunOptions? options = null, CancellationToken cancellationToken = default) =>
        this.Change(await this.InnerAgent.RunAsync(messages, session, options, cancellationToken).ConfigureAwait(false));

    protected override async IAsyncEnumerable<AgentResponseUpdate> RunCoreStreamingAsync(IEnumerable<ChatMessage> messages,
        AgentSession? session = null, AgentRunOptions? options = null,
        [EnumeratorCancellation] CancellationToken cancellationToken = default)
    {
        AgentResponse response = await this.InnerAgent.RunStreamingAsync(messages, session, options, cancellationToken)
            .ToAgentResponseAsync(cancellationToken).ConfigureAwait(false);
        foreach (AgentResponseUpdate update in this.Change(response).ToAgentResponseUpdates())
        {
            yield return update;
        }
    }

    private AgentResponse Change(AgentResponse response)
    {
        AgentPlan plan = plans[Math.Min(Interlocked.Increment(ref this._calls), plans.Length) - 1];
        switch (plan.Report)
        {
            case Report.HalveUsage when response.Usage is { } usage:
                response.Usage = new UsageDetails
                {
                    InputTokenCount = usage.InputTokenCount / 2,
                    OutputTokenCount = usage.OutputTokenCount / 2,
                    TotalTokenCount = usage.InputTokenCount / 2 + usage.OutputTokenCount / 2,
                };
                break;
            case Report.DropCached when response.Usage is { } usage:
                response.Usage = new UsageDetails
                {
                    InputTokenCount = usage.InputTokenCount - (usage.CachedInputTokenCount ?? 0),
                    OutputTokenCount = usage.OutputTokenCount,
                    TotalTokenCount = usage.TotalTokenCount - (usage.CachedInputTokenCount ?? 0),
                    ReasoningTokenCount = usage.ReasoningTokenCount,
                };
                break;
            case Report.DoubleUsage when response.Usage is { } usage:
                response.Usage = new UsageDetails
                {
                    InputTokenCount = 2 * usage.InputTokenCount,
                    OutputTokenCount = 2 * usage.OutputTokenCount,
                    TotalTokenCount = 2 * usage.TotalTokenCount,
                };
                break;
            case Report.SuppressFinish:
                response.FinishReason = null;
                break;
            case Report.LastCallOnly:
                ScriptedCall last = plan.Calls.Last(c => !c.Fails);
                response.Usage = new UsageDetails
                {
                    InputTokenCount = last.InputTokens,
                    OutputTokenCount = last.OutputTokens,
                    TotalTokenCount = last.Total,
                };
                break;
        }
        return response;
    }
}
