using System.ClientModel;
using Microsoft.Agents.AI;
using Microsoft.Agents.AI.Workflows;
using Microsoft.Extensions.AI;
using AgentEval.Instrumentation.MafFidelity;
using OpenAI;

namespace FidelityScenarios;

/// <summary>What the collector must say of one workflow run, from how it was built.</summary>
public sealed record Expectation(IReadOnlyList<AgentPlan> Plans, IReadOnlyList<string>? NonAgentExecutors = null)
{
    /// <summary>
    /// Per agent: its verdict and numbers (tolerance 2%, finish reasons compared); the run's status.
    /// <paramref name="ledger"/>: the ledger package records the framework's side (else the collector
    /// falls back on MAF's <c>invoke_agent</c> span, which sees the response before any middleware
    /// outside it).
    /// </summary>
    public object Said(bool ledger)
    {
        var units = this.Plans.ToDictionary(p => p.Name, p => p.Expected(ledger));
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
        IChatClient? chatClient = null, ChatClientAgentOptions? options = null)
    {
        IChatClient chat = chatClient ?? new ScriptedChatClient(Model, plan.Calls).AsBuilder().UseOpenTelemetry().Build();
        AIAgent agent = new ChatClientAgent(chat, options ?? new ChatClientAgentOptions { Name = plan.Name });
        AIAgentBuilder builder = agent.AsBuilder();
        if (decorate)
        {
            builder = builder.UseFidelityLedger();
        }
        if (plan.Report != Report.Honest)
        {
            builder = builder.Use(inner => new MisreportingAgent(inner, plan));
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
            await using StreamingRun run = await InProcessExecution.RunStreamingAsync(workflow,
                new ChatMessage(ChatRole.User, "Draft a release note."));
            await run.TrySendMessageAsync(new TurnToken(emitEvents: true));
            await foreach (WorkflowEvent e in run.WatchStreamAsync().WithFidelityLedger())
            {
                if (e is RequestInfoEvent request)
                {
                    await run.SendResponseAsync(request.Request.CreateResponse("approved, tighten it"));
                }
            }
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

    /// <summary>The OpenAI-compatible server the OpenAI scenarios call (--openai), and what it must answer them.</summary>
    public static Uri? OpenAIEndpoint { get; set; }

    /// <summary>researcher -> writer on MAF's OpenAI chat client, each agent its own model on the server.</summary>
    private static ScenarioRun OpenAIGraph(Report writer)
    {
        AgentPlan[] plans = [new("researcher", [new(120, 40)]), new("writer", [new(300, 200)], writer)];
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
    /// NewEvents), its AgentResponseEvents recorded by the ledger where <paramref name="ledger"/>.
    /// </summary>
    private static async Task RunWorkflow<TInput>(Workflow workflow, TInput input, bool streaming, bool ledger)
        where TInput : notnull
    {
        if (streaming)
        {
            await using StreamingRun run = await InProcessExecution.RunStreamingAsync(workflow, input);
            await run.TrySendMessageAsync(new TurnToken(emitEvents: true));
            IAsyncEnumerable<WorkflowEvent> events = run.WatchStreamAsync();
            await foreach (WorkflowEvent _ in ledger ? events.WithFidelityLedger() : events)
            {
            }
        }
        else
        {
            await using Run run = await InProcessExecution.RunAsync(workflow, input);
            foreach (WorkflowEvent _ in ledger ? run.NewEvents.WithFidelityLedger() : run.NewEvents)
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
