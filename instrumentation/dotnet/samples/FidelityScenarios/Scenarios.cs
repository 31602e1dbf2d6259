using System.ClientModel;
using Microsoft.Agents.AI;
using Microsoft.Agents.AI.Workflows;
using Microsoft.Extensions.AI;
using AgentEval.Instrumentation.MafFidelity;
using OpenAI;

namespace FidelityScenarios;

/// <summary>
/// What the collector must say of one workflow run, from how it was built. <paramref name="Unjoined"/>:
/// its ledger spans carry no identity of their run and other runs beside it share its executors.
/// </summary>
/// <paramref name="Unordered"/>: its unnamed agents start at once (a concurrent builder), so which is
/// <c>unnamed-agent-2</c> is the run's to say: the units are compared as a set of verdicts and numbers.
public sealed record Expectation(IReadOnlyList<AgentPlan> Plans, IReadOnlyList<string>? NonAgentExecutors = null,
    bool Unjoined = false, bool Unordered = false)
{
    /// <summary>
    /// Per agent: its verdict and numbers (tolerance 2%, finish reasons compared); the run's status.
    /// <paramref name="ledger"/>: the ledger package records the framework's side (else the collector
    /// falls back on MAF's <c>invoke_agent</c> span, which sees the response before any middleware
    /// outside it).
    /// </summary>
    public object Said(bool ledger)
    {
        var units = this.Plans.ToDictionary(p => p.Name, p => p.Expected(ledger, this.Unjoined));
        double[] scores = units.Values.Where(u => u.Verdict != "NoTruth").Select(u => Score(u.Verdict)).ToArray();
        bool someUnchecked = units.Values.Any(u => u.Verdict == "NoTruth");
        double? score = scores.Length > 0 ? scores.Average() : null;
        return new
        {
            status = score switch
            {
                null => "PENDING",
                >= 0.99 => someUnchecked ? "WARN" : "PASS",
                >= 0.80 => "WARN",
                _ => "FAIL",
            },
            ledger,
            non_agent_executors = this.NonAgentExecutors ?? [],
            unordered = this.Unordered,
            units,
        };
    }

    private static double Score(string verdict) => verdict switch
    {
        "Agree" => 1.0,
        "Both" => 0.0,
        _ => 0.5,
    };
}

/// <summary>
/// One trace of a scenario: what runs in it, and the workflow runs it holds (one, or one per turn of
/// a human-in-the-loop workflow), in order.
/// </summary>
public sealed record ScenarioRun(Func<Task> Run, IReadOnlyList<Expectation> Workflows, bool Ledger = true)
{
    /// <summary>Its agents call the model server of --openai, each as the model <c>{agent}-model</c>.</summary>
    public bool ModelServer { get; init; }

    public ScenarioRun(Func<Task> run, IReadOnlyList<AgentPlan> plans, bool ledger = true,
        IReadOnlyList<string>? nonAgentExecutors = null)
        : this(run, [new Expectation(plans, nonAgentExecutors)], ledger)
    {
    }

    public IEnumerable<object> Expected() => this.Workflows.Select(w => w.Said(this.Ledger));
}

/// <summary>A scenario: its runs, each in a trace of its own.</summary>
public sealed record Scenario(string Name, IReadOnlyList<ScenarioRun> Runs)
{
    /// <summary>Per trace, its workflow runs' expectations.</summary>
    public object Expected() => this.Runs.Select(r => r.Expected().ToList()).ToList();
}

/// <summary>The scenarios, each a workflow as users write them with MAF .NET.</summary>
public static class Scenarios
{
    private static readonly AIAgentHostOptions EmitResponses = new() { EmitAgentResponseEvents = true };
    private const string Model = "gpt-4o-mini";

    public static readonly IReadOnlyDictionary<string, Scenario> All = new[]
    {
        Named("graph-honest", Graph(streaming: true)),
        Named("graph-honest-run", Graph(streaming: false)),
        Named("graph-under-reported", Graph(streaming: true, writer: Report.HalveUsage)),
        Named("graph-suppressed-finish", Graph(streaming: true, reviewer: Report.SuppressFinish)),
        // Without the ledger package MAF's invoke_agent is the framework's side: it sees the usage
        // before the middleware outside UseOpenTelemetry halves it, so the under-report goes unseen.
        Named("graph-under-reported-no-ledger", Graph(streaming: true, writer: Report.HalveUsage, ledger: false)),
        // Agents without UseOpenTelemetry: their chat spans sit right under their executor's span.
        Named("graph-agents-without-telemetry", Graph(streaming: true, writer: Report.HalveUsage, agentTelemetry: false)),
        Named("tool-loop-per-call-honest", ToolLoop(Report.Honest, spanAroundLoop: false)),
        Named("tool-loop-per-call-last-call-only", ToolLoop(Report.LastCallOnly, spanAroundLoop: false)),
        Named("tool-loop-around-honest", ToolLoop(Report.Honest, spanAroundLoop: true)),
        Named("tool-loop-around-last-call-only", ToolLoop(Report.LastCallOnly, spanAroundLoop: true)),
        Named("function-executor", FunctionExecutor()),
        Named("failed-call", FailedCall()),
        Named("direct-agent-under-reported", DirectAgent(Report.HalveUsage)),
        Named("sequential-builder", Orchestration(agents => AgentWorkflowBuilder.BuildSequential(agents), Report.HalveUsage)),
        Named("concurrent-builder", Orchestration(agents => AgentWorkflowBuilder.BuildConcurrent(agents), Report.SuppressFinish)),
        Named("group-chat", GroupChat()),
        Named("handoff", Handoff()),
        Named("human-in-the-loop", HumanInTheLoop()),
        Named("workflow-as-agent", WorkflowAsAgent()),
        // Several runs under one caller span: each judged on the ledger recorded in it (WithFidelityLedger(run)).
        Named("runs-one-after-another", RunsOneAfterAnother(withRun: true)),
        Named("runs-one-after-another-without-the-run", RunsOneAfterAnother(withRun: false)),
        Named("runs-at-once", RunsAtOnce()),
        Named("session-three-turns", SessionThreeTurns()),
        // The agent decorator and the workflow's events both record each response: counted once.
        Named("recorded-twice-honest", RecordedTwice(Report.Honest)),
        Named("recorded-twice-under-reported", RecordedTwice(Report.HalveUsage)),
        Named("nested-workflow-agent-honest", NestedWorkflowAgent(Report.Honest)),
        Named("nested-workflow-agent-under-reported", NestedWorkflowAgent(Report.HalveUsage)),
        Named("over-reported", Graph(streaming: true, writer: Report.DoubleUsage)),
        Named("cached-and-reasoning-honest", CachedAndReasoning(Report.Honest)),
        Named("cached-dropped", CachedAndReasoning(Report.DropCached)),
        // Agents without a name, as most of MAF's samples create them: each its own unit, unnamed-agent-1, -2, ...
        Named("unnamed-graph-honest", UnnamedGraph(Report.Honest)),
        Named("unnamed-graph-under-reported", UnnamedGraph(Report.HalveUsage)),
        Named("unnamed-sequential-honest", UnnamedOrchestration(AgentWorkflowBuilder.BuildSequential, Report.Honest)),
        Named("unnamed-sequential-under-reported", UnnamedOrchestration(AgentWorkflowBuilder.BuildSequential, Report.HalveUsage)),
        Named("unnamed-concurrent-honest", UnnamedOrchestration(agents => AgentWorkflowBuilder.BuildConcurrent(agents), Report.Honest,
            unordered: true)),
        Named("unnamed-concurrent-under-reported", UnnamedOrchestration(agents => AgentWorkflowBuilder.BuildConcurrent(agents),
            Report.HalveUsage, unordered: true)),
        Named("unnamed-group-chat-honest", UnnamedGroupChat(Report.Honest)),
        Named("unnamed-group-chat-under-reported", UnnamedGroupChat(Report.HalveUsage)),
        Named("unnamed-in-custom-executor-honest", UnnamedInCustomExecutor(Report.Honest)),
        Named("unnamed-in-custom-executor-under-reported", UnnamedInCustomExecutor(Report.HalveUsage)),
        // MAF's real OpenAI client (Microsoft.Extensions.AI.OpenAI) against the model server of --openai.
        Named("openai-honest", OpenAIGraph(Report.Honest)),
        Named("openai-under-reported", OpenAIGraph(Report.HalveUsage)),
    }.ToDictionary(s => s.Name);

    private static Scenario Named(string name, params ScenarioRun[] runs) => new(name, runs);

    /// <summary>
    /// A chat client agent as MAF's samples set one up, with telemetry on its chat client and on itself;
    /// <paramref name="decorate"/> adds the ledger's agent decorator, outermost. A middleware that
    /// misreports sits outside UseOpenTelemetry, so MAF's own agent span still sees the truth.
    /// </summary>
    public static AIAgent Agent(AgentPlan plan, bool agentTelemetry = true, bool decorate = false,
        IChatClient? chatClient = null, ChatClientAgentOptions? options = null) =>
        Agent([plan], agentTelemetry, decorate, chatClient, options);

    /// <summary>One agent that runs once per plan (its turns, one run each), the n-th call following the n-th plan.</summary>
    private static AIAgent Agent(AgentPlan[] turns, bool agentTelemetry = true, bool decorate = false,
        IChatClient? chatClient = null, ChatClientAgentOptions? options = null)
    {
        IChatClient chat = chatClient
            ?? new ScriptedChatClient(Model, [.. turns.SelectMany(t => t.Calls)]).AsBuilder().UseOpenTelemetry().Build();
        AIAgent agent = new ChatClientAgent(chat, options ?? new ChatClientAgentOptions { Name = turns[0].Unnamed ? null : turns[0].Name });
        AIAgentBuilder builder = agent.AsBuilder();
        if (decorate)
        {
            builder = builder.UseFidelityLedger();
        }
        if (turns.Any(t => t.Report != Report.Honest))
        {
            builder = builder.Use(inner => new MisreportingAgent(inner, turns));
        }
        return (agentTelemetry ? builder.UseOpenTelemetry() : builder).Build();
    }

    /// <summary>researcher -> writer -> reviewer, each bound with EmitAgentResponseEvents.</summary>
    private static ScenarioRun Graph(bool streaming, Report writer = Report.Honest, Report reviewer = Report.Honest,
        bool ledger = true, bool agentTelemetry = true)
    {
        AgentPlan[] plans =
        [
            new("researcher", [new(120, 40)]),
            new("writer", [new(300, 200, Finish(writer))], writer),
            new("reviewer", [new(80, 20, Finish(reviewer))], reviewer),
        ];
        return new ScenarioRun(
            () => RunWorkflow(Chain(plans.Select(p => Agent(p, agentTelemetry).BindAsExecutor(EmitResponses)).ToArray()),
                new ChatMessage(ChatRole.User, "Write a short note on tides."), streaming, ledger),
            plans, ledger);
    }

    /// <summary>A suppressing middleware hides a content_filter finish: that is what its script answers.</summary>
    private static string Finish(Report report) => report == Report.SuppressFinish ? "content_filter" : "stop";

    /// <summary>
    /// A planner calling a tool twice, then a writer. The tool loop is Microsoft.Extensions.AI's
    /// FunctionInvokingChatClient: outside the chat client's UseOpenTelemetry (a chat span per model
    /// call: ChatClientAgent's default) or inside it (the builder's first Use is outermost: one chat
    /// span around the whole loop).
    /// </summary>
    private static ScenarioRun ToolLoop(Report planner, bool spanAroundLoop)
    {
        AgentPlan plannerPlan = new("planner",
            [new(100, 20, "tool_calls", CallTool: "lookup"), new(150, 30, "tool_calls", CallTool: "lookup"), new(200, 50)],
            planner);
        AgentPlan writerPlan = new("writer", [new(300, 200)]);
        AITool lookup = AIFunctionFactory.Create(() => "high tide at 06:12", "lookup");
        var scripted = new ScriptedChatClient(Model, plannerPlan.Calls);
        IChatClient chat = spanAroundLoop
            ? scripted.AsBuilder().UseOpenTelemetry().UseFunctionInvocation().Build()
            : scripted.AsBuilder().UseOpenTelemetry().Build();
        var options = new ChatClientAgentOptions
        {
            Name = plannerPlan.Name,
            ChatOptions = new ChatOptions { Tools = [lookup] },
            UseProvidedChatClientAsIs = spanAroundLoop,
        };
        return new ScenarioRun(() => RunWorkflow(Chain(
                Agent(plannerPlan, chatClient: chat, options: options).BindAsExecutor(EmitResponses),
                Agent(writerPlan).BindAsExecutor(EmitResponses)),
                new ChatMessage(ChatRole.User, "When is high tide?"), streaming: true, ledger: true),
            [plannerPlan, writerPlan]);
    }

    /// <summary>A function executor (string to chat message and turn token) ahead of two agents.</summary>
    private static ScenarioRun FunctionExecutor()
    {
        AgentPlan[] plans = [new("researcher", [new(120, 40)]), new("writer", [new(300, 200)])];
        var toChat = new StringToChatExecutor("StringToChat");
        ExecutorBinding[] agents = plans.Select(p => Agent(p).BindAsExecutor(EmitResponses)).ToArray();
        WorkflowBuilder builder = new WorkflowBuilder(toChat).AddEdge(toChat, agents[0]);
        return new ScenarioRun(() => RunWorkflow(Chain(builder, agents), "tides", streaming: true, ledger: true),
            plans, nonAgentExecutors: ["StringToChat"]);
    }

    /// <summary>The writer's model call fails: the workflow stops there, the reviewer never runs.</summary>
    private static ScenarioRun FailedCall()
    {
        AgentPlan[] plans = [new("researcher", [new(120, 40)]), new("writer", [new(0, 0, Fails: true)])];
        AgentPlan reviewer = new("reviewer", [new(80, 20)]);
        return new ScenarioRun(() => RunWorkflow(Chain(
                [.. plans.Select(p => Agent(p).BindAsExecutor(EmitResponses)), Agent(reviewer).BindAsExecutor(EmitResponses)]),
                new ChatMessage(ChatRole.User, "Write a short note on tides."), streaming: true, ledger: true),
            plans);
    }

    /// <summary>An agent run on its own (no workflow), its ledger from the agent decorator.</summary>
    private static ScenarioRun DirectAgent(Report report)
    {
        AgentPlan plan = new("assistant", [new(90, 30)], report);
        return new ScenarioRun(async () => await Agent(plan, decorate: true).RunAsync("When is high tide?"), [plan]);
    }

    /// <summary>
    /// Three agents in a workflow built by AgentWorkflowBuilder, as users call it: its agent executors
    /// emit no AgentResponseEvent, so each agent carries the ledger's decorator; the second misreports.
    /// </summary>
    private static ScenarioRun Orchestration(Func<AIAgent[], Workflow> build, Report second)
    {
        AgentPlan[] plans =
        [
            new("french", [new(60, 20)]),
            new("spanish", [new(70, 25, Finish(second))], second),
            new("english", [new(80, 30)]),
        ];
        return new ScenarioRun(() => RunWorkflow(build(plans.Select(p => Agent(p, decorate: true)).ToArray()),
            new List<ChatMessage> { new(ChatRole.User, "Hello, world!") }, streaming: true, ledger: true), plans);
    }

    /// <summary>Round-robin group chat of two agents, two turns each; the critic under-reports each turn.</summary>
    private static ScenarioRun GroupChat()
    {
        AgentPlan[] plans =
        [
            new("writer", [new(100, 50), new(180, 60)]),
            new("critic", [new(120, 30), new(200, 40)], Report.HalveUsage),
        ];
        return new ScenarioRun(() => RunWorkflow(
            AgentWorkflowBuilder.CreateGroupChatBuilderWith(agents => new RoundRobinGroupChatManager(agents) { MaximumIterationCount = 4 })
                .AddParticipants(plans.Select(p => Agent(p, decorate: true)))
                .Build(),
            new List<ChatMessage> { new(ChatRole.User, "Draft a slogan.") }, streaming: true, ledger: true), plans);
    }

    /// <summary>A triage agent hands off to a math tutor (its handoff tool call is a model call of its own).</summary>
    private static ScenarioRun Handoff()
    {
        AgentPlan triage = new("triage", [new(90, 10, "tool_calls", CallTool: "handoff_to_*")]);
        AgentPlan tutor = new("math_tutor", [new(150, 80)], Report.HalveUsage);
        return new ScenarioRun(() =>
        {
            AIAgent triageAgent = Agent(triage, decorate: true), tutorAgent = Agent(tutor, decorate: true);
            Workflow workflow = AgentWorkflowBuilder.CreateHandoffBuilderWith(triageAgent)
                .WithHandoffs(triageAgent, [tutorAgent])
                .Build();
            return RunWorkflow(workflow, new List<ChatMessage> { new(ChatRole.User, "What is 12 * 7?") }, streaming: true,
                ledger: true);
        }, [triage, tutor]);
    }

    /// <summary>
    /// A writer drafts (under-reporting); a function executor asks a person through a request port; the
    /// answer, in a second turn of the same run, goes to a reviser. The writer forwards only its own
    /// response (by default an agent executor also forwards what it received: two drafts, two questions).
    /// </summary>
    private static ScenarioRun HumanInTheLoop()
    {
        AgentPlan writer = new("writer", [new(140, 60)], Report.HalveUsage);
        AgentPlan reviser = new("reviser", [new(220, 90)]);
        return new ScenarioRun(async () =>
        {
            ExecutorBinding draft = Agent(writer).BindAsExecutor(
                new AIAgentHostOptions { EmitAgentResponseEvents = true, ForwardIncomingMessages = false });
            ExecutorBinding revise = Agent(reviser).BindAsExecutor(EmitResponses);
            var ask = new AskForApprovalExecutor("AskForApproval");
            RequestPort approval = RequestPort.Create<string, string>("Approval");
            var toChat = new StringToChatExecutor("ApprovalToChat");
            Workflow workflow = new WorkflowBuilder(draft)
                .AddEdge(draft, ask).AddEdge(ask, approval).AddEdge(approval, toChat).AddEdge(toChat, revise)
                .WithOutputFrom(revise).WithOpenTelemetry().Build();
            await RunTurns(workflow, new ChatMessage(ChatRole.User, "Draft a release note."), "approved, tighten it", turns: 2);
        }, [new Expectation([writer], ["Approval", "AskForApproval"]), new Expectation([reviser], ["Approval", "ApprovalToChat"])]);
    }

    /// <summary>A two-agent workflow hosted as an agent (<c>workflow.AsAIAgent()</c>) and called as one.</summary>
    private static ScenarioRun WorkflowAsAgent()
    {
        AgentPlan[] plans = [new("researcher", [new(120, 40)]), new("writer", [new(300, 200)], Report.HalveUsage)];
        return new ScenarioRun(async () =>
        {
            Workflow workflow = Chain(plans.Select(p => Agent(p, decorate: true).BindAsExecutor()).ToArray());
            AIAgent pipeline = workflow.AsAIAgent(name: "pipeline");
            await pipeline.RunAsync("Write a short note on tides.");
        }, plans);
    }

    /// <summary>
    /// One workflow run three times under the caller's span, its writer under-reporting in the second run
    /// only. Given the run, each ledger span sits in the run that produced it; without it (the
    /// package's older call) the three runs' ledgers cannot be told apart, and none is compared.
    /// </summary>
    private static ScenarioRun RunsOneAfterAnother(bool withRun)
    {
        AgentPlan[] researcher = [.. Enumerable.Range(0, 3).Select(_ => new AgentPlan("researcher", [new(120, 40)]))];
        AgentPlan[] writer = [.. new[] { Report.Honest, Report.HalveUsage, Report.Honest }
            .Select(r => new AgentPlan("writer", [new(300, 200)], r))];
        return new ScenarioRun(async () =>
        {
            Workflow workflow = Chain(Agent(researcher).BindAsExecutor(EmitResponses), Agent(writer).BindAsExecutor(EmitResponses));
            for (int i = 0; i < 3; i++)
            {
                await RunWorkflow(workflow, new ChatMessage(ChatRole.User, "Write a short note on tides."), streaming: i != 1,
                    ledger: true, withRun);
            }
        }, [.. Enumerable.Range(0, 3).Select(i => new Expectation([researcher[i], writer[i]], Unjoined: !withRun))]);
    }

    /// <summary>
    /// Two workflows of one definition (each its own agents) running at once under the caller's span, the
    /// second's writer under-reporting: the lie is pinned on its own run. The second starts once the
    /// first has, so their runs start in that order.
    /// </summary>
    private static ScenarioRun RunsAtOnce()
    {
        AgentPlan[][] plans = [.. new[] { Report.Honest, Report.HalveUsage }.Select(r => new AgentPlan[]
            { new("researcher", [new(120, 40)]), new("writer", [new(300, 200)], r) })];
        return new ScenarioRun(async () =>
        {
            Workflow[] workflows = [.. plans.Select(p => Chain([.. p.Select(a => Agent(a).BindAsExecutor(EmitResponses))]))];
            await using StreamingRun first = await InProcessExecution.RunStreamingAsync(workflows[0],
                new ChatMessage(ChatRole.User, "Write a short note on tides."));
            await first.TrySendMessageAsync(new TurnToken(emitEvents: true));
            IAsyncEnumerator<WorkflowEvent> firstEvents = first.WatchStreamAsync().WithFidelityLedger(first).GetAsyncEnumerator();
            try
            {
                await firstEvents.MoveNextAsync();  // the first run has started
                Task second = RunWorkflow(workflows[1], new ChatMessage(ChatRole.User, "Write a short note on tides."),
                    streaming: true, ledger: true);
                while (await firstEvents.MoveNextAsync())
                {
                }
                await second;
            }
            finally
            {
                await firstEvents.DisposeAsync();
            }
        }, [.. plans.Select(p => new Expectation(p))]);
    }

    /// <summary>
    /// One session of three turns (a StreamingRun): a writer drafts, a person is asked, their answer goes
    /// back to the writer. Its middleware under-reports in the second turn only; each turn is a run of
    /// its own, judged on its own ledger.
    /// </summary>
    private static ScenarioRun SessionThreeTurns()
    {
        AgentPlan[] writer = [.. new[] { Report.Honest, Report.HalveUsage, Report.Honest }
            .Select((r, i) => new AgentPlan("writer", [new(140 + 100 * i, 60)], r))];
        return new ScenarioRun(async () =>
        {
            ExecutorBinding draft = Agent(writer).BindAsExecutor(
                new AIAgentHostOptions { EmitAgentResponseEvents = true, ForwardIncomingMessages = false });
            var ask = new AskForApprovalExecutor("AskForApproval");
            RequestPort approval = RequestPort.Create<string, string>("Approval");
            var toChat = new StringToChatExecutor("ApprovalToChat");
            Workflow workflow = new WorkflowBuilder(draft)
                .AddEdge(draft, ask).AddEdge(ask, approval).AddEdge(approval, toChat).AddEdge(toChat, draft)
                .WithOutputFrom(draft).WithOpenTelemetry().Build();
            // the person walks away after the third draft
            await RunTurns(workflow, new ChatMessage(ChatRole.User, "Draft a release note."), "tighten it", turns: 3);
        },
        [
            new Expectation([writer[0]], ["Approval", "AskForApproval"]),
            new Expectation([writer[1]], ["Approval", "ApprovalToChat", "AskForApproval"]),
            new Expectation([writer[2]], ["Approval", "ApprovalToChat", "AskForApproval"]),
        ]);
    }

    /// <summary>
    /// A session of turns: each read until the workflow halts for a person's answer
    /// (<c>WatchStreamAsync(blockOnPendingRequest: false)</c>), which starts the next. Answered while the
    /// stream goes on (MAF's samples' <c>WatchStreamAsync()</c>), a turn is a run of its own only if the
    /// workflow halted before the answer came: MAF may run both in one <c>invoke_workflow</c>, by timing.
    /// </summary>
    private static async Task RunTurns(Workflow workflow, ChatMessage input, string answer, int turns)
    {
        await using StreamingRun run = await InProcessExecution.RunStreamingAsync(workflow, input);
        await run.TrySendMessageAsync(new TurnToken(emitEvents: true));
        for (int turn = 1; turn <= turns; turn++)
        {
            RequestInfoEvent? asked = null;
            await foreach (WorkflowEvent e in run.WatchStreamAsync(blockOnPendingRequest: false).WithFidelityLedger(run))
            {
                asked = e as RequestInfoEvent ?? asked;
            }
            if (asked is null || turn == turns)
            {
                break;
            }
            await run.SendResponseAsync(asked.Request.CreateResponse(answer));
        }
    }

    /// <summary>researcher -> writer, each agent with the ledger's decorator and bound to emit its events.</summary>
    private static ScenarioRun RecordedTwice(Report writer)
    {
        AgentPlan[] plans = [new("researcher", [new(120, 40)]), new("writer", [new(300, 200)], writer)];
        return new ScenarioRun(() => RunWorkflow(Chain([.. plans.Select(p => Agent(p, decorate: true).BindAsExecutor(EmitResponses))]),
            new ChatMessage(ChatRole.User, "Write a short note on tides."), streaming: true, ledger: true), plans);
    }

    /// <summary>
    /// A two-agent workflow as an agent (<c>workflow.AsAIAgent()</c>), bound as an executor of an outer
    /// workflow that emits its AgentResponseEvents, after an outer agent: the inner agents (with the
    /// ledger's decorator) are the units, the workflow-agent's executor is listed beside them.
    /// </summary>
    private static ScenarioRun NestedWorkflowAgent(Report writer)
    {
        AgentPlan intake = new("intake", [new(60, 20)]);
        AgentPlan[] inner = [new("researcher", [new(120, 40)]), new("writer", [new(300, 200)], writer)];
        return new ScenarioRun(() =>
        {
            AIAgent pipeline = Chain([.. inner.Select(p => Agent(p, decorate: true).BindAsExecutor())]).AsAIAgent(name: "pipeline");
            Workflow outer = Chain(Agent(intake).BindAsExecutor(EmitResponses), pipeline.BindAsExecutor(EmitResponses));
            return RunWorkflow(outer, new ChatMessage(ChatRole.User, "Write a short note on tides."), streaming: true, ledger: true);
        }, [new Expectation([intake, .. inner], ["pipeline"])]);
    }

    /// <summary>Agents whose calls read cached input and reason (parts of their counts); the writer's middleware may drop the cached part.</summary>
    private static ScenarioRun CachedAndReasoning(Report writer)
    {
        AgentPlan[] plans =
        [
            new("researcher", [new(400, 100, CachedInputTokens: 300)]),
            new("writer", [new(900, 300, CachedInputTokens: 600, ReasoningTokens: 120)], writer),
        ];
        return new ScenarioRun(() => RunWorkflow(Chain([.. plans.Select(p => Agent(p).BindAsExecutor(EmitResponses))]),
            new ChatMessage(ChatRole.User, "Write a short note on tides."), streaming: true, ledger: true), plans);
    }

    /// <summary>Three agents without a name, in a graph, bound to emit their events; the second may misreport.</summary>
    private static ScenarioRun UnnamedGraph(Report second)
    {
        AgentPlan[] plans = Unnamed(second, n => $"unnamed-agent-{n}");
        return new ScenarioRun(() => RunWorkflow(Chain([.. plans.Select(p => Agent(p).BindAsExecutor(EmitResponses))]),
            new ChatMessage(ChatRole.User, "Write a short note on tides."), streaming: true, ledger: true), plans);
    }

    /// <summary>Three agents without a name in an AgentWorkflowBuilder workflow, with the ledger's decorator; the second may misreport.</summary>
    private static ScenarioRun UnnamedOrchestration(Func<AIAgent[], Workflow> build, Report second, bool unordered = false)
    {
        AgentPlan[] plans = Unnamed(second, n => $"unnamed-agent-{n}");
        return new ScenarioRun(() => RunWorkflow(build([.. plans.Select(p => Agent(p, decorate: true))]),
            new List<ChatMessage> { new(ChatRole.User, "Hello, world!") }, streaming: true, ledger: true),
            [new Expectation(plans, Unordered: unordered)]);
    }

    /// <summary>Round-robin group chat of two agents without a name, two turns each; the second may misreport each turn.</summary>
    private static ScenarioRun UnnamedGroupChat(Report second)
    {
        AgentPlan[] plans =
        [
            new("unnamed-agent-1", [new(100, 50), new(180, 60)]) { Unnamed = true },
            new("unnamed-agent-2", [new(120, 30), new(200, 40)], second) { Unnamed = true },
        ];
        return new ScenarioRun(() => RunWorkflow(
            AgentWorkflowBuilder.CreateGroupChatBuilderWith(agents => new RoundRobinGroupChatManager(agents) { MaximumIterationCount = 4 })
                .AddParticipants(plans.Select(p => Agent(p, decorate: true)))
                .Build(),
            new List<ChatMessage> { new(ChatRole.User, "Draft a slogan.") }, streaming: true, ledger: true), plans);
    }

    /// <summary>
    /// A custom executor whose handler runs an agent without a name (with the ledger's decorator), as
    /// MAF's custom agent executor samples do, ahead of a named reviewer; the unnamed agent may misreport.
    /// </summary>
    private static ScenarioRun UnnamedInCustomExecutor(Report drafter)
    {
        AgentPlan draft = new("Drafter/unnamed-agent-1", [new(150, 70)], drafter) { Unnamed = true };
        AgentPlan reviewer = new("reviewer", [new(90, 30)]);
        return new ScenarioRun(() =>
        {
            var drafting = new AgentRunningExecutor("Drafter", Agent(draft, decorate: true));
            ExecutorBinding reviewing = Agent(reviewer).BindAsExecutor(EmitResponses);
            Workflow workflow = new WorkflowBuilder(drafting).AddEdge(drafting, reviewing).WithOutputFrom(reviewing)
                .WithOpenTelemetry().Build();
            return RunWorkflow(workflow, "tides", streaming: true, ledger: true);
        }, [draft, reviewer]);
    }

    /// <summary>Three plans for agents without a name, the second misreporting as <paramref name="second"/>.</summary>
    private static AgentPlan[] Unnamed(Report second, Func<int, string> name) =>
    [
        new(name(1), [new(120, 40)]) { Unnamed = true },
        new(name(2), [new(300, 200, Finish(second))], second) { Unnamed = true },
        new(name(3), [new(80, 20)]) { Unnamed = true },
    ];

    /// <summary>The OpenAI-compatible server the OpenAI scenarios call (--openai), and what it must answer them.</summary>
    public static Uri? OpenAIEndpoint { get; set; }

    /// <summary>
    /// researcher -> writer on MAF's OpenAI chat client, each agent its own model on the server (whose
    /// usage, as that client reads it, reports no cached or reasoning tokens: 0 of each).
    /// </summary>
    private static ScenarioRun OpenAIGraph(Report writer)
    {
        AgentPlan[] plans =
        [
            new("researcher", [new(120, 40, CachedInputTokens: 0, ReasoningTokens: 0)]),
            new("writer", [new(300, 200, CachedInputTokens: 0, ReasoningTokens: 0)], writer),
        ];
        return new ScenarioRun(() =>
        {
            Uri endpoint = OpenAIEndpoint ?? throw new InvalidOperationException("this scenario needs --openai URL");
            var openai = new OpenAIClient(new ApiKeyCredential("not-needed"), new OpenAIClientOptions { Endpoint = endpoint });
            ExecutorBinding[] agents = plans.Select(p => Agent(p,
                    chatClient: openai.GetChatClient($"{p.Name}-model").AsIChatClient().AsBuilder().UseOpenTelemetry().Build())
                .BindAsExecutor(EmitResponses)).ToArray();
            return RunWorkflow(Chain(agents), new ChatMessage(ChatRole.User, "Write a short note on tides."), streaming: true,
                ledger: true);
        }, plans) { ModelServer = true };
    }

    private static Workflow Chain(params ExecutorBinding[] executors) => Chain(new WorkflowBuilder(executors[0]), executors);

    private static Workflow Chain(WorkflowBuilder builder, ExecutorBinding[] executors)
    {
        for (int i = 1; i < executors.Length; i++)
        {
            builder.AddEdge(executors[i - 1], executors[i]);
        }
        return builder.WithOutputFrom(executors[^1]).WithOpenTelemetry().Build();
    }

    /// <summary>
    /// Runs a workflow as MAF's samples do: streamed with a TurnToken (or with RunAsync and its
    /// NewEvents), its AgentResponseEvents recorded by the ledger where <paramref name="ledger"/>, given
    /// the run (docs/dotnet.md) unless <paramref name="withRun"/> is false (the package's older call).
    /// </summary>
    private static async Task RunWorkflow<TInput>(Workflow workflow, TInput input, bool streaming, bool ledger,
        bool withRun = true)
        where TInput : notnull
    {
        if (streaming)
        {
            await using StreamingRun run = await InProcessExecution.RunStreamingAsync(workflow, input);
            await run.TrySendMessageAsync(new TurnToken(emitEvents: true));
            IAsyncEnumerable<WorkflowEvent> events = run.WatchStreamAsync();
            await foreach (WorkflowEvent _ in !ledger ? events : withRun ? events.WithFidelityLedger(run) : events.WithFidelityLedger())
            {
            }
        }
        else
        {
            await using Run run = await InProcessExecution.RunAsync(workflow, input);
            IEnumerable<WorkflowEvent> events = run.NewEvents;
            foreach (WorkflowEvent _ in !ledger ? events : withRun ? events.WithFidelityLedger(run) : events.WithFidelityLedger())
            {
            }
        }
    }
}

/// <summary>A function executor asking a person (through the request port after it) to approve a draft.</summary>
[SendsMessage(typeof(string))]
internal sealed class AskForApprovalExecutor(string id) : Executor<List<ChatMessage>>(id)
{
    public override async ValueTask HandleAsync(List<ChatMessage> message, IWorkflowContext context,
        CancellationToken cancellationToken = default) =>
        await context.SendMessageAsync($"Approve this draft? ({message.Count} message(s))", cancellationToken: cancellationToken);
}

/// <summary>
/// A custom executor that runs its agent inside its handler (MAF's custom agent executor samples): a
/// topic in, the agent's answer on to the next executor as a chat message and a turn token.
/// </summary>
[SendsMessage(typeof(ChatMessage))]
[SendsMessage(typeof(TurnToken))]
internal sealed class AgentRunningExecutor(string id, AIAgent agent) : Executor<string>(id)
{
    public override async ValueTask HandleAsync(string message, IWorkflowContext context, CancellationToken cancellationToken = default)
    {
        AgentResponse response = await agent.RunAsync($"Write a short note on {message}.", cancellationToken: cancellationToken);
        await context.SendMessageAsync(new ChatMessage(ChatRole.User, response.Text), cancellationToken: cancellationToken);
        await context.SendMessageAsync(new TurnToken(emitEvents: true), cancellationToken: cancellationToken);
    }
}

/// <summary>A function executor, as MAF's mixed-workflow sample has: a string in, a chat message and a turn token out.</summary>
[SendsMessage(typeof(ChatMessage))]
[SendsMessage(typeof(TurnToken))]
internal sealed class StringToChatExecutor(string id) : Executor<string>(id)
{
    public override async ValueTask HandleAsync(string message, IWorkflowContext context, CancellationToken cancellationToken = default)
    {
        await context.SendMessageAsync(new ChatMessage(ChatRole.User, message), cancellationToken: cancellationToken);
        await context.SendMessageAsync(new TurnToken(emitEvents: true), cancellationToken: cancellationToken);
    }
}
