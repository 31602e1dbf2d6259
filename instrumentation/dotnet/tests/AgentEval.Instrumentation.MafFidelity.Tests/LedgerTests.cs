using System.Collections.Concurrent;
using System.Diagnostics;
using AgentEval.Instrumentation.MafFidelity;
using FidelityScenarios;
using Microsoft.Agents.AI;
using Microsoft.Agents.AI.Workflows;
using Microsoft.Extensions.AI;
using Xunit;

namespace AgentEval.Instrumentation.MafFidelity.Tests;

/// <summary>What the ledger records, on real MAF agents and workflows over a scripted chat client.</summary>
public sealed class LedgerTests : IDisposable
{
    private const string CallerSource = "LedgerTests.Caller";
    private static readonly ActivitySource Caller = new(CallerSource);
    private readonly ConcurrentQueue<Activity> _spans = new();
    private readonly ActivityListener _listener;

    public LedgerTests()
    {
        // The app's tracer provider, as far as a test needs one: every source of MafFidelity.AllSourceNames.
        _listener = new ActivityListener
        {
            ShouldListenTo = s => MafFidelity.AllSourceNames.Contains(s.Name) || s.Name == CallerSource,
            Sample = (ref ActivityCreationOptions<ActivityContext> _) => ActivitySamplingResult.AllDataAndRecorded,
            ActivityStopped = _spans.Enqueue,
        };
        ActivitySource.AddActivityListener(_listener);
    }

    public void Dispose() => _listener.Dispose();

    private Activity[] Ledger() => _spans.Where(a => a.Source.Name == MafFidelity.ActivitySourceName).ToArray();

    private static AIAgent Agent(string name, params ScriptedCall[] calls) =>
        new ChatClientAgent(new ScriptedChatClient("gpt-4o-mini", calls).AsBuilder().UseOpenTelemetry().Build(),
            new ChatClientAgentOptions { Name = name });

    [Fact]
    public async Task Every_AgentResponseEvent_of_a_streamed_workflow_becomes_a_ledger_span_under_the_caller()
    {
        ExecutorBinding researcher = Agent("researcher", new ScriptedCall(120, 40))
            .BindAsExecutor(new AIAgentHostOptions { EmitAgentResponseEvents = true });
        ExecutorBinding writer = Agent("writer", new ScriptedCall(300, 200, "length"))
            .BindAsExecutor(new AIAgentHostOptions { EmitAgentResponseEvents = true });
        Workflow workflow = new WorkflowBuilder(researcher).AddEdge(researcher, writer).WithOutputFrom(writer)
            .WithOpenTelemetry().Build();

        Activity caller = Caller.StartActivity("caller")!;
        int events = 0;
        await using (StreamingRun run = await InProcessExecution.RunStreamingAsync(workflow, new ChatMessage(ChatRole.User, "go")))
        {
            await run.TrySendMessageAsync(new TurnToken(emitEvents: true));
            await foreach (WorkflowEvent e in run.WatchStreamAsync().WithFidelityLedger())
            {
                events += e is AgentResponseEvent ? 1 : 0;
            }
        }
        caller.Stop();

        Activity[] ledger = Ledger();
        Assert.Equal(2, events);
        Assert.Equal(2, ledger.Length);
        Assert.All(ledger, span =>
        {
            Assert.Equal(caller.SpanId, span.ParentSpanId);
            Assert.Equal("AgentResponseEvent", span.GetTagItem("fidelity.ledger.source"));
            Assert.Equal("active", span.GetTagItem("fidelity.instrumentation.status"));
            Assert.Equal(MafFidelity.MafRelease, span.GetTagItem("fidelity.maf.version"));
            Assert.StartsWith("dotnet-1.", MafFidelity.MafRelease);
            // A workflow event names its executor, not an agent: the collector joins it to that executor's run.
            Assert.Null(span.GetTagItem("gen_ai.agent.name"));
            Assert.Null(span.GetTagItem("fidelity.agent.name"));
        });
        Activity written = Assert.Single(ledger, s => ((string)s.GetTagItem("executor.id")!).StartsWith("writer_", StringComparison.Ordinal));
        Assert.Equal(300L, written.GetTagItem("gen_ai.usage.input_tokens"));
        Assert.Equal(200L, written.GetTagItem("gen_ai.usage.output_tokens"));
        Assert.Equal(500L, written.GetTagItem("gen_ai.usage.total_tokens"));
        Assert.Equal(new[] { "length" }, written.GetTagItem("gen_ai.response.finish_reasons"));
        Assert.StartsWith("agent_response writer_", written.DisplayName, StringComparison.Ordinal);
    }

    [Fact]
    public async Task Given_the_run_each_response_is_recorded_under_the_executor_span_that_produced_it()
    {
        // One workflow run three times under one caller span (streamed, RunAsync, streamed): its
        // AgentResponseEvents reach the caller after each run's spans ended, as they do in an app.
        ExecutorBinding writer = Agent("writer", new ScriptedCall(300, 200), new ScriptedCall(310, 200), new ScriptedCall(320, 200))
            .BindAsExecutor(new AIAgentHostOptions { EmitAgentResponseEvents = true });
        Workflow workflow = new WorkflowBuilder(writer).WithOutputFrom(writer).WithOpenTelemetry().Build();
        var sessions = new List<string>();

        using (Caller.StartActivity("caller"))
        {
            for (int i = 0; i < 3; i++)
            {
                if (i == 1)
                {
                    await using Run run = await InProcessExecution.RunAsync(workflow, new ChatMessage(ChatRole.User, "go"));
                    sessions.Add(run.SessionId);
                    foreach (WorkflowEvent _ in run.NewEvents.WithFidelityLedger(run))
                    {
                    }
                    continue;
                }
                await using StreamingRun streaming = await InProcessExecution.RunStreamingAsync(workflow, new ChatMessage(ChatRole.User, "go"));
                sessions.Add(streaming.SessionId);
                await streaming.TrySendMessageAsync(new TurnToken(emitEvents: true));
                await foreach (WorkflowEvent _ in streaming.WatchStreamAsync().WithFidelityLedger(streaming))
                {
                }
            }
        }

        Activity[] ledger = Ledger();
        Assert.Equal(3, ledger.Length);
        Assert.Equal(3, sessions.Distinct().Count());
        for (int i = 0; i < 3; i++)
        {
            Activity span = Assert.Single(ledger, s => (long)s.GetTagItem("gen_ai.usage.input_tokens")! == 300 + 10 * i);
            // Under the executor span of its own run: its executor's, in the run of its session.
            Activity host = Assert.Single(_spans, s => s.SpanId == span.ParentSpanId);
            Assert.StartsWith("executor.process writer_", host.OperationName, StringComparison.Ordinal);
            Assert.Equal(sessions[i], span.GetTagItem("session.id"));
            Activity run = Assert.Single(_spans, s => s.SpanId == host.ParentSpanId);
            Assert.Equal(sessions[i], run.GetTagItem("session.id"));
        }
    }

    [Theory]
    [InlineData(true, 400L)]
    [InlineData(false, 200L)]
    public async Task UseFidelityTruth_keeps_the_chat_span_true_to_what_the_provider_sent(bool truthLayer, long recorded)
    {
        // A chat middleware outside the chat telemetry that halves the usage in the very updates it
        // receives: without the truth-keeping layer the chat span records its edit (the known limit).
        ChatClientBuilder builder = new ScriptedChatClient("gpt-4o-mini", new ScriptedCall(400, 100)).AsBuilder()
            .Use(inner => new HalvingInPlace(inner));
        IChatClient chat = (truthLayer ? builder.UseFidelityTruth() : builder).UseOpenTelemetry().Build();

        long? seen = null;
        await foreach (ChatResponseUpdate update in chat.GetStreamingResponseAsync("hello"))
        {
            seen = update.Contents.OfType<UsageContent>().FirstOrDefault()?.Details.InputTokenCount ?? seen;
        }

        Activity span = Assert.Single(_spans, s => s.Source.Name == MafFidelity.ChatSourceName);
        Assert.Equal(recorded, Convert.ToInt64(span.GetTagItem("gen_ai.usage.input_tokens"), System.Globalization.CultureInfo.InvariantCulture));
        Assert.Equal(200L, seen);  // the caller got the edit either way
    }

    /// <summary>A chat middleware that halves the input tokens of the updates it passes on, in place.</summary>
    private sealed class HalvingInPlace(IChatClient inner) : DelegatingChatClient(inner)
    {
        public override async IAsyncEnumerable<ChatResponseUpdate> GetStreamingResponseAsync(IEnumerable<ChatMessage> messages,
            ChatOptions? options = null, [System.Runtime.CompilerServices.EnumeratorCancellation] CancellationToken cancellationToken = default)
        {
            await foreach (ChatResponseUpdate update in base.GetStreamingResponseAsync(messages, options, cancellationToken))
            {
                foreach (UsageContent usage in update.Contents.OfType<UsageContent>())
                {
                    usage.Details.InputTokenCount /= 2;
                }
                yield return update;
            }
        }
    }

    [Fact]
    public async Task The_decorator_records_what_the_caller_got_under_the_agents_own_span()
    {
        AIAgent agent = Agent("solo", new ScriptedCall(50, 10, "stop")).AsBuilder()
            .UseFidelityLedger()
            .Use(inner => new MisreportingAgent(inner, new AgentPlan("solo", [new(50, 10)], Report.HalveUsage)))
            .UseOpenTelemetry()
            .Build();

        AgentResponse response = await agent.RunAsync("hello");

        Activity span = Assert.Single(Ledger());
        Activity agentSpan = Assert.Single(_spans, s => s.Source.Name == MafFidelity.AgentSourceName);
        Assert.Equal(agentSpan.SpanId, span.ParentSpanId);
        Assert.Equal("solo", span.GetTagItem("fidelity.agent.name"));
        Assert.Equal("agent_response solo", span.DisplayName);
        // What the caller received, after the under-reporting middleware: 25 + 5.
        Assert.Equal(response.Usage!.TotalTokenCount, 30);
        Assert.Equal(30L, span.GetTagItem("gen_ai.usage.total_tokens"));
        Assert.Equal(false, span.GetTagItem("fidelity.stream"));
    }

    [Fact]
    public async Task A_stream_closed_early_records_what_it_had_and_says_so()
    {
        AIAgent agent = Agent("streamer", new ScriptedCall(40, 8, "stop")).AsBuilder().UseFidelityLedger().Build();

        await foreach (AgentResponseUpdate _ in agent.RunStreamingAsync("hello"))
        {
            break;
        }

        Activity span = Assert.Single(Ledger());
        Assert.Equal(true, span.GetTagItem("fidelity.stream"));
        Assert.Equal(true, span.GetTagItem("fidelity.stream.closed_early"));
    }

    [Fact]
    public async Task A_stream_read_to_the_end_records_its_usage_and_finish()
    {
        AIAgent agent = Agent("streamer", new ScriptedCall(40, 8, "content_filter")).AsBuilder().UseFidelityLedger().Build();

        await foreach (AgentResponseUpdate _ in agent.RunStreamingAsync("hello"))
        {
        }

        Activity span = Assert.Single(Ledger());
        Assert.Null(span.GetTagItem("fidelity.stream.closed_early"));
        Assert.Equal(48L, span.GetTagItem("gen_ai.usage.total_tokens"));
        Assert.Equal(new[] { "content_filter" }, span.GetTagItem("gen_ai.response.finish_reasons"));
    }

    [Fact]
    public async Task A_call_that_throws_records_nothing()
    {
        AIAgent agent = Agent("failing", new ScriptedCall(0, 0, Fails: true)).AsBuilder().UseFidelityLedger().Build();

        await Assert.ThrowsAsync<HttpRequestException>(() => agent.RunAsync("hello"));

        Assert.Empty(Ledger());
    }

    [Fact]
    public async Task Cached_and_reasoning_parts_are_recorded_never_message_text()
    {
        var response = new AgentResponse(new ChatMessage(ChatRole.Assistant, "a secret answer"))
        {
            Usage = new UsageDetails { InputTokenCount = 100, OutputTokenCount = 30, CachedInputTokenCount = 60, ReasoningTokenCount = 12 },
            FinishReason = ChatFinishReason.Stop,
        };
        new AgentResponseEvent("planner_1", response).RecordFidelityLedger();

        Activity span = Assert.Single(Ledger());
        Assert.Equal(60L, span.GetTagItem("gen_ai.usage.cache_read.input_tokens"));
        Assert.Equal(12L, span.GetTagItem("gen_ai.usage.reasoning.output_tokens"));
        Assert.Equal("planner_1", span.GetTagItem("executor.id"));
        Assert.DoesNotContain(span.TagObjects, t => t.Value?.ToString()?.Contains("secret", StringComparison.Ordinal) == true);
        await Task.CompletedTask;
    }
}
