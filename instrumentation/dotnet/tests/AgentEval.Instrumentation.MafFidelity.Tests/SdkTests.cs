using System.Collections.Concurrent;
using System.Diagnostics;
using System.Diagnostics.Tracing;
using AgentEval.Instrumentation.MafFidelity;
using FidelityScenarios;
using Microsoft.Agents.AI;
using Microsoft.Agents.AI.Workflows;
using Microsoft.Extensions.AI;
using OpenTelemetry;
using OpenTelemetry.Trace;
using Xunit;

// The ledger's sources are process-wide: one test at a time, so no test sees another's spans.
[assembly: CollectionBehavior(DisableTestParallelization = true)]

namespace AgentEval.Instrumentation.MafFidelity.Tests;

/// <summary>The package through the real OpenTelemetry SDK: a tracer provider with the in-memory exporter.</summary>
public sealed class SdkTests
{
    private static AIAgent Agent(string name, string? agentSource, string? chatSource, params ScriptedCall[] calls) =>
        new ChatClientAgent(new ScriptedChatClient("gpt-4o-mini", calls).AsBuilder().UseOpenTelemetry(sourceName: chatSource).Build(),
                new ChatClientAgentOptions { Name = name })
            .AsBuilder().UseFidelityLedger().UseOpenTelemetry(sourceName: agentSource).Build();

    [Fact]
    public async Task The_provider_extension_records_the_ledger_under_the_agent_span()
    {
        var exported = new List<Activity>();
        using (TracerProvider provider = Sdk.CreateTracerProviderBuilder()
                   .AddMafFidelityInstrumentation()
                   .AddInMemoryExporter(exported)
                   .Build())
        {
            await Agent("plain", agentSource: null, chatSource: null, new ScriptedCall(20, 5)).RunAsync("hello");
        }

        Activity ledger = Assert.Single(exported, a => a.Source.Name == MafFidelity.ActivitySourceName);
        Activity agent = Assert.Single(exported, a => a.Source.Name == MafFidelity.AgentSourceName);
        Assert.Single(exported, a => a.Source.Name == MafFidelity.ChatSourceName);
        Assert.Equal(agent.SpanId, ledger.ParentSpanId);
        Assert.Equal(25L, ledger.GetTagItem("gen_ai.usage.total_tokens"));
    }

    [Fact]
    public async Task Extra_agent_and_chat_sources_are_recorded_and_the_decorator_knows_their_agent_spans()
    {
        var exported = new List<Activity>();
        using (TracerProvider provider = Sdk.CreateTracerProviderBuilder()
                   .AddMafFidelityInstrumentation(options =>
                   {
                       options.AgentSourceNames.Add("MyApp.Agents");
                       options.ChatSourceNames.Add("MyApp.Chat");
                   })
                   .AddInMemoryExporter(exported)
                   .Build())
        {
            await Agent("custom", "MyApp.Agents", "MyApp.Chat", new ScriptedCall(30, 7)).RunAsync("hello");
        }

        Activity agent = Assert.Single(exported, a => a.Source.Name == "MyApp.Agents");
        Assert.Single(exported, a => a.Source.Name == "MyApp.Chat");
        Activity ledger = Assert.Single(exported, a => a.Source.Name == MafFidelity.ActivitySourceName);
        Assert.Equal(agent.SpanId, ledger.ParentSpanId);
        Assert.Equal("custom", ledger.GetTagItem("fidelity.agent.name"));
    }

    [Fact]
    public async Task An_always_off_sampler_records_nothing_and_throws_nothing()
    {
        var exported = new List<Activity>();
        using (TracerProvider provider = Sdk.CreateTracerProviderBuilder()
                   .AddMafFidelityInstrumentation()
                   .SetSampler(new AlwaysOffSampler())
                   .AddInMemoryExporter(exported)
                   .Build())
        {
            AIAgent agent = Agent("unsampled", null, null, new ScriptedCall(10, 2), new ScriptedCall(10, 2));
            await agent.RunAsync("hello");
            await foreach (AgentResponseUpdate _ in agent.RunStreamingAsync("hello"))
            {
            }
        }

        Assert.Empty(exported);
    }

    [Fact]
    public async Task Null_arguments_throw_at_the_call()
    {
        Assert.Throws<ArgumentNullException>(() => ((TracerProviderBuilder)null!).AddMafFidelityInstrumentation());
        Assert.Throws<ArgumentNullException>(() => ((TracerProviderBuilder)null!).AddMafFidelityInstrumentation(_ => { }));
        Assert.Throws<ArgumentException>(() => Sdk.CreateTracerProviderBuilder()
            .AddMafFidelityInstrumentation(options => options.AgentSourceNames.Add(" ")));
        Assert.Throws<ArgumentNullException>(() => ((AIAgentBuilder)null!).UseFidelityLedger());
        Assert.Throws<ArgumentNullException>(() => ((ChatClientBuilder)null!).UseFidelityTruth());
        Assert.Throws<ArgumentNullException>(() => new FidelityLedgerAgent(null!));

        // Streams check their arguments when called, before anything is enumerated.
        var truth = new FidelityTruthChatClient(new ScriptedChatClient("gpt-4o-mini"));
        Assert.Throws<ArgumentNullException>(() => truth.GetStreamingResponseAsync((IEnumerable<ChatMessage>)null!));
        AIAgent agent = new ChatClientAgent(new ScriptedChatClient("gpt-4o-mini"), new ChatClientAgentOptions { Name = "n" })
            .AsBuilder().UseFidelityLedger().Build();
        // AIAgent.RunStreamingAsync (MAF's) calls the decorator only when its stream is first read: it throws there.
        await Assert.ThrowsAsync<ArgumentNullException>(async () =>
        {
            await foreach (AgentResponseUpdate _ in agent.RunStreamingAsync((IEnumerable<ChatMessage>)null!))
            {
            }
        });
        Assert.Throws<ArgumentNullException>(() => ((IAsyncEnumerable<WorkflowEvent>)null!).WithFidelityLedger());
        Assert.Throws<ArgumentNullException>(() => ((IEnumerable<WorkflowEvent>)null!).WithFidelityLedger());
    }

    [Fact]
    public void All_source_names_are_read_only_and_still_go_to_AddSource()
    {
        IReadOnlyList<string> names = MafFidelity.AllSourceNames;
        Assert.Equal([MafFidelity.ActivitySourceName, MafFidelity.WorkflowSourceName, MafFidelity.AgentSourceName,
            MafFidelity.ChatSourceName], names);
        string[] copy = MafFidelity.AllSourceNames;
        copy[0] = "changed";
        Assert.Equal(MafFidelity.ActivitySourceName, MafFidelity.AllSourceNames[0]);
        using TracerProvider provider = Sdk.CreateTracerProviderBuilder().AddSource(MafFidelity.AllSourceNames).Build();
    }

    [Fact]
    public async Task The_event_source_says_a_ledger_span_was_not_written_when_nothing_listens()
    {
        using var diagnostics = new Diagnostics();
        // No tracer provider: nothing listens to the ledger source.
        AIAgent agent = new ChatClientAgent(new ScriptedChatClient("gpt-4o-mini", new ScriptedCall(10, 2), new ScriptedCall(10, 2)),
            new ChatClientAgentOptions { Name = "unheard" }).AsBuilder().UseFidelityLedger().Build();
        await agent.RunAsync("hello");
        await foreach (AgentResponseUpdate _ in agent.RunStreamingAsync("hello"))
        {
        }

        EventWrittenEventArgs[] notRecorded = diagnostics.Events.Where(e => e.EventName == "LedgerSpanNotRecorded").ToArray();
        Assert.Equal(2, notRecorded.Length);
        Assert.All(notRecorded, e =>
        {
            Assert.Equal(EventLevel.Warning, e.Level);
            Assert.Equal("unheard", e.Payload![0]);
            Assert.Equal(MafFidelity.ActivitySourceName, e.Payload[1]);
        });
    }

    [Fact]
    public async Task The_event_source_says_a_stream_failed_and_no_agent_span_was_found()
    {
        using var diagnostics = new Diagnostics();
        var exported = new List<Activity>();
        using TracerProvider provider = Sdk.CreateTracerProviderBuilder().AddMafFidelityInstrumentation()
            .AddInMemoryExporter(exported).Build();
        // Without UseOpenTelemetry: no invoke_agent span.
        AIAgent agent = new ChatClientAgent(new ScriptedChatClient("gpt-4o-mini", new ScriptedCall(10, 2), new ScriptedCall(0, 0, Fails: true)),
            new ChatClientAgentOptions { Name = "bare" }).AsBuilder().UseFidelityLedger().Build();
        await agent.RunAsync("hello");
        await Assert.ThrowsAsync<HttpRequestException>(async () =>
        {
            await foreach (AgentResponseUpdate _ in agent.RunStreamingAsync("hello"))
            {
            }
        });

        EventWrittenEventArgs notFound = Assert.Single(diagnostics.Events, e => e.EventName == "AgentSpanNotFound");
        Assert.Equal("bare", notFound.Payload![0]);
        EventWrittenEventArgs failed = Assert.Single(diagnostics.Events, e => e.EventName == "StreamFailed");
        Assert.Equal("bare", failed.Payload![0]);
        Assert.Equal(typeof(HttpRequestException).FullName, failed.Payload[1]);
    }

    [Fact]
    public async Task The_event_source_says_no_executor_span_was_found_for_a_runs_response()
    {
        using var diagnostics = new Diagnostics();
        var exported = new List<Activity>();
        using TracerProvider provider = Sdk.CreateTracerProviderBuilder().AddMafFidelityInstrumentation()
            .AddInMemoryExporter(exported).Build();
        ExecutorBinding writer = new ChatClientAgent(new ScriptedChatClient("gpt-4o-mini", new ScriptedCall(30, 10)),
                new ChatClientAgentOptions { Name = "writer" })
            .BindAsExecutor(new AIAgentHostOptions { EmitAgentResponseEvents = true });
        // No WithOpenTelemetry(): MAF starts no executor.process span to record under.
        Workflow workflow = new WorkflowBuilder(writer).WithOutputFrom(writer).Build();
        await using (StreamingRun run = await InProcessExecution.RunStreamingAsync(workflow, new ChatMessage(ChatRole.User, "go")))
        {
            await run.TrySendMessageAsync(new TurnToken(emitEvents: true));
            await foreach (WorkflowEvent _ in run.WatchStreamAsync().WithFidelityLedger(run))
            {
            }
        }

        EventWrittenEventArgs notFound = Assert.Single(diagnostics.Events, e => e.EventName == "ExecutorSpanNotFound");
        Assert.StartsWith("writer", (string)notFound.Payload![0]!, StringComparison.Ordinal);
        Assert.Single(exported, a => a.Source.Name == MafFidelity.ActivitySourceName);
    }

    /// <summary>An in-process listener of the package's EventSource, as an app would read it.</summary>
    private sealed class Diagnostics : EventListener
    {
        public ConcurrentQueue<EventWrittenEventArgs> Events { get; } = new();

        protected override void OnEventSourceCreated(EventSource eventSource)
        {
            if (eventSource.Name == "AgentEval-Instrumentation-MafFidelity")
            {
                this.EnableEvents(eventSource, EventLevel.Verbose);
            }
        }

        protected override void OnEventWritten(EventWrittenEventArgs eventData) => this.Events.Enqueue(eventData);
    }
}
