using System.Runtime.CompilerServices;
using Microsoft.Extensions.AI;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// Keeps the chat truth intact: hands each streamed update outward as a copy of its own (its contents
/// list and usage copied), so a middleware further out that edits the updates it receives in place
/// cannot change what <c>UseOpenTelemetry()</c> beneath this layer records when the stream ends
/// (Microsoft.Extensions.AI's chat span reads the updates it handed out). A plain response is recorded
/// before it is returned, and passes through untouched.
/// </summary>
/// <remarks>Add it right before <c>UseOpenTelemetry()</c>:
/// <c>client.AsBuilder().UseFidelityTruth().UseOpenTelemetry().Build()</c>.</remarks>
public sealed class FidelityTruthChatClient : DelegatingChatClient
{
    /// <summary>Wraps <paramref name="innerClient"/>.</summary>
    public FidelityTruthChatClient(IChatClient innerClient) : base(innerClient)
    {
    }

    /// <inheritdoc />
    public override IAsyncEnumerable<ChatResponseUpdate> GetStreamingResponseAsync(IEnumerable<ChatMessage> messages,
        ChatOptions? options = null, CancellationToken cancellationToken = default)
    {
        // Checked at the call, not on the stream's first MoveNextAsync.
        ArgumentNullException.ThrowIfNull(messages);
        return this.CopiedAsync(messages, options, cancellationToken);
    }

    private async IAsyncEnumerable<ChatResponseUpdate> CopiedAsync(IEnumerable<ChatMessage> messages, ChatOptions? options,
        [EnumeratorCancellation] CancellationToken cancellationToken)
    {
        await foreach (ChatResponseUpdate update in base.GetStreamingResponseAsync(messages, options, cancellationToken)
                           .ConfigureAwait(false))
        {
            yield return Copy(update);
        }
    }

    private static ChatResponseUpdate Copy(ChatResponseUpdate update)
    {
        ChatResponseUpdate copy = update.Clone();
        copy.Contents = [.. update.Contents.Select(content => content is UsageContent usage ? Copy(usage) : content)];
        return copy;
    }

    private static UsageContent Copy(UsageContent usage) => new(new UsageDetails
    {
        InputTokenCount = usage.Details.InputTokenCount,
        OutputTokenCount = usage.Details.OutputTokenCount,
        TotalTokenCount = usage.Details.TotalTokenCount,
        CachedInputTokenCount = usage.Details.CachedInputTokenCount,
        ReasoningTokenCount = usage.Details.ReasoningTokenCount,
        AdditionalCounts = usage.Details.AdditionalCounts is { } counts ? new(counts) : null,
    })
    {
        AdditionalProperties = usage.AdditionalProperties,
        RawRepresentation = usage.RawRepresentation,
    };
}

/// <summary>The truth-keeping layer as one more <c>Use...</c> in a chat client's builder chain.</summary>
public static class FidelityTruthChatClientBuilderExtensions
{
    /// <summary>
    /// Hands streamed updates outward as copies, so what <c>UseOpenTelemetry()</c> records of a call is what
    /// the provider sent, whatever a middleware outside does to them. Add it right before
    /// <c>UseOpenTelemetry()</c>: <c>client.AsBuilder().UseFidelityTruth().UseOpenTelemetry().Build()</c>.
    /// </summary>
    public static ChatClientBuilder UseFidelityTruth(this ChatClientBuilder builder)
    {
        ArgumentNullException.ThrowIfNull(builder);
        return builder.Use(inner => new FidelityTruthChatClient(inner));
    }
}
