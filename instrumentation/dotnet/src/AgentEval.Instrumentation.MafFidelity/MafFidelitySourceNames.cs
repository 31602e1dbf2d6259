using System.Collections;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// A read-only list of ActivitySource names (<see cref="MafFidelity.AllSourceNames"/>). It converts to a
/// <see cref="string"/> array of its own, so <c>TracerProviderBuilder.AddSource(MafFidelity.AllSourceNames)</c>
/// reads as before; nothing a caller does to that array changes the list.
/// </summary>
public sealed class MafFidelitySourceNames : IReadOnlyList<string>
{
    private readonly string[] _names;

    internal MafFidelitySourceNames(string[] names) => this._names = names;

    /// <inheritdoc />
    public int Count => this._names.Length;

    /// <inheritdoc />
    public string this[int index] => this._names[index];

    /// <summary>A copy of the names, as an array of its own.</summary>
    public string[] ToArray() => (string[])this._names.Clone();

    /// <inheritdoc />
    public IEnumerator<string> GetEnumerator() => ((IEnumerable<string>)this._names).GetEnumerator();

    IEnumerator IEnumerable.GetEnumerator() => this.GetEnumerator();

    /// <summary>A copy of the names, as an array of its own (null: an empty array).</summary>
    public static implicit operator string[](MafFidelitySourceNames? names) => names?.ToArray() ?? [];
}
