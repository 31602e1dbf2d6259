using System.Runtime.CompilerServices;
using Microsoft.Extensions.AI;

namespace FidelityScenarios;

/// <summary>
/// One model call as the script answers it: its usage and finish reason, a tool call, or a failure.
/// A <paramref name="CallTool"/> ending in <c>*</c> calls the first tool offered whose name starts so
/// (a handoff tool, named by the builder). The cached and reasoning tokens are parts of the input and
/// output tokens, as Microsoft.Extensions.AI counts them (null: not reported).
/// </summary>
public sealed record ScriptedCall(int InputTokens, int OutputTokens, string Finish = "stop", string? CallTool = null,
    bool Fails = false, int? CachedInputTokens = null, int? ReasoningTokens = null)
{
    public int Total => this.InputTokens + this.OutputTokens;
}

/// <summary>
/// A chat client that answers each call from its script, in order (usage, finish reasons and failures on
/// demand), and names its model through <see cref="ChatClientMetadata"/> so chat spans are <c>chat {model}</c>.
/// </summary>
public sealed class ScriptedChatClient(string model, params ScriptedCall[] script) : IChatClient
{
    private readonly Queue<ScriptedCall> _script = new(script);
    private readonly ChatClientMetadata _metadata = new("scripted", new Uri("http://127.0.0.1/scripted"), model);

    public IReadOnlyList<ScriptedCall> Script { get; } = script;

    public Task<ChatResponse> GetResponseAsync(IEnumerable<ChatMessage> messages, ChatOptions? options = null,
        CancellationToken cancellationToken = default)
    {
        ScriptedCall call;
        lock (this._script)
        {
            call = this._script.Count > 0 ? this._script.Dequeue()
                : throw new InvalidOperationException($"the script of {model} has no call left");
        }
        if (call.Fails)
        {
            throw new HttpRequestException("scripted failure: the model server answered 500");
        }
        AIContent content = call.CallTool is { } tool
            ? new FunctionCallContent(Guid.NewGuid().ToString("N"), Offered(tool, options))
            : new TextContent($"{model} answers");
        return Task.FromResult(new ChatResponse(new ChatMessage(ChatRole.Assistant, [content]))
        {
            ModelId = model,
            FinishReason = new ChatFinishReason(call.Finish),
            Usage = new UsageDetails
            {
                InputTokenCount = call.InputTokens,
                OutputTokenCount = call.OutputTokens,
                TotalTokenCount = call.Total,
                CachedInputTokenCount = call.CachedInputTokens,
                ReasoningTokenCount = call.ReasoningTokens,
            },
        });
    }

    private static string Offered(string tool, ChatOptions? options) =>
        !tool.EndsWith('*') ? tool
        : options?.Tools?.FirstOrDefault(t => t.Name.StartsWith(tool[..^1], StringComparison.Ordinal))?.Name
          ?? throw new InvalidOperationException($"no tool offered matches {tool}");

    public async IAsyncEnumerable<ChatResponseUpdate> GetStreamingResponseAsync(IEnumerable<ChatMessage> messages,
        ChatOptions? options = null, [EnumeratorCancellation] CancellationToken cancellationToken = default)
    {
        ChatResponse response = await this.GetResponseAsync(messages, options, cancellationToken).ConfigureAwait(false);
        foreach (ChatResponseUpdate update in response.ToChatResponseUpdates())
        {
            yield return update;
        }
    }

    public object? GetService(Type serviceType, object? serviceKey = null) =>
        serviceKey is null && serviceType.IsInstanceOfType(this._metadata) ? this._metadata
        : serviceKey is null && serviceType.IsInstanceOfType(this) ? this : null;

    public void Dispose()
    {
    }
}
