using System.Diagnostics;
using System.Text.Json;
using AgentEval.Instrumentation.MafFidelity;
using OpenTelemetry;
using OpenTelemetry.Exporter;
using OpenTelemetry.Resources;
using OpenTelemetry.Trace;

namespace FidelityScenarios;

/// <summary>
/// dotnet run -- SCENARIO --endpoint http://127.0.0.1:4317 [--protocol grpc|http] [--openai URL]
/// Runs one scenario's real MAF workflow, exports its spans over OTLP and prints, as one JSON line,
/// its trace ids and what the collector must say of it, worked out from how it was built.
/// dotnet run -- list              prints the scenario names.
/// dotnet run -- script SCENARIO   prints what the OpenAI-compatible server of --openai must answer it.
/// </summary>
public static class Program
{
    private static readonly ActivitySource App = new("FidelityScenarios");

    public static async Task<int> Main(string[] args)
    {
        if (args is ["list"])
        {
            Console.WriteLine(string.Join('\n', Scenarios.All.Keys));
            return 0;
        }
        if (args is ["script", string scripted] && Scenarios.All.TryGetValue(scripted, out Scenario? toScript))
        {
            // What a model server must answer a scenario, per model: {model: [{input_tokens, output_tokens, finish}]}.
            Console.WriteLine(JsonSerializer.Serialize(toScript.Runs.Where(r => r.ModelServer)
                .SelectMany(r => r.Workflows).SelectMany(w => w.Plans).ToDictionary(
                    p => $"{p.Name}-model",
                    p => p.Calls.Select(c => new { input_tokens = c.InputTokens, output_tokens = c.OutputTokens, finish = c.Finish }))));
            return 0;
        }
        if (args.Length < 3 || !Scenarios.All.TryGetValue(args[0], out Scenario? scenario))
        {
            Console.Error.WriteLine("usage: FidelityScenarios SCENARIO --endpoint URL [--protocol grpc|http] | list");
            return 2;
        }
        string endpoint = Option(args, "--endpoint") ?? throw new ArgumentException("--endpoint is required");
        bool http = Option(args, "--protocol") == "http";
        if (Option(args, "--openai") is string openai)
        {
            Scenarios.OpenAIEndpoint = new Uri(openai.TrimEnd('/') + "/v1");
        }

        var traceIds = new List<string>();
        using (TracerProvider provider = Sdk.CreateTracerProviderBuilder()
                   .SetResourceBuilder(ResourceBuilder.CreateDefault().AddService(scenario.Name))
                   .AddSource(App.Name)
                   .AddMafFidelityInstrumentation()
                   .AddOtlpExporter(o =>
                   {
                       o.Protocol = http ? OtlpExportProtocol.HttpProtobuf : OtlpExportProtocol.Grpc;
                       o.Endpoint = new Uri(http ? endpoint.TrimEnd('/') + "/v1/traces" : endpoint);
                   })
                   .Build())
        {
            foreach (ScenarioRun run in scenario.Runs)
            {
                // The caller's own span around each workflow run, as MAF's samples do.
                using (Activity? root = App.StartActivity($"scenario {scenario.Name}"))
                {
                    traceIds.Add(root!.TraceId.ToHexString());
                    await run.Run();
                }
            }
            provider.ForceFlush();
        }
        Console.WriteLine(JsonSerializer.Serialize(new
        {
            scenario = scenario.Name,
            maf_release = MafFidelity.MafRelease,
            trace_ids = traceIds,
            expected = scenario.Expected(),
        }, new JsonSerializerOptions { PropertyNamingPolicy = JsonNamingPolicy.SnakeCaseLower }));
        return 0;
    }

    private static string? Option(string[] args, string name)
    {
        int i = Array.IndexOf(args, name);
        return i >= 0 && i + 1 < args.Length ? args[i + 1] : null;
    }
}
