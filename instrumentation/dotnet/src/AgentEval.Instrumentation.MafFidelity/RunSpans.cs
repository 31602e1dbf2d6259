using System.Collections.Concurrent;
using System.Diagnostics;
using Microsoft.Agents.AI.Workflows;

namespace AgentEval.Instrumentation.MafFidelity;

/// <summary>
/// Which executor span of a run each of its events came from, read off MAF's own workflow spans
/// (<c>WithOpenTelemetry()</c>), so a ledger span written when the caller reads an
/// <see cref="AgentResponseEvent"/> sits in the run that produced it: joined by identity, never by time.
/// </summary>
/// <remarks>
/// MAF starts an <c>executor.process</c> span for each executor invocation and, inside it, raises an
/// <see cref="ExecutorInvokedEvent"/> before any event of the handler's own; a run's events reach its
/// reader in the order they were raised. So the n-th <see cref="ExecutorInvokedEvent"/> of an executor that
/// a run's reader sees is the n-th <c>executor.process</c> span of that executor in that run's session
/// (found through the span's <c>session.id</c>, on MAF's run span above it), and an AgentResponseEvent
/// belongs to the invocation its executor's last ExecutorInvokedEvent announced. Two invocations of one
/// executor at once can only be of one turn: the run is right either way.
/// </remarks>
internal static class RunSpans
{
    private const string SessionIdTag = "session.id";
    private const string ExecutorIdTag = "executor.id";
    private const string ExecutorProcess = "executor.process";
    private const string WorkflowSession = "workflow.session";

    private static readonly ConcurrentDictionary<string, Session> Sessions = new(StringComparer.Ordinal);

    /// <summary>When this listener started: a session begun before it cannot be followed.</summary>
    private static readonly DateTime ListeningSince = DateTime.UtcNow;

    /// <summary>Sees MAF's workflow spans start and the sessions end; samples nothing itself.</summary>
    private static readonly ActivityListener Listener = Listen();

    /// <summary>
    /// Starts listening, if not yet. It must be before a run starts (the package's first use does it:
    /// <see cref="MafFidelity"/>'s names, <c>AddMafFidelityInstrumentation()</c>); a session begun
    /// earlier is not followed, and its ledger spans carry no identity of their run.
    /// </summary>
    internal static void EnsureListening() => GC.KeepAlive(Listener);

    /// <summary>
    /// Reads one event of the run of <paramref name="sessionId"/>, in stream order; for an
    /// <see cref="AgentResponseEvent"/>, the span of the executor invocation that raised it (default: none seen).
    /// </summary>
    internal static ActivityContext Read(string sessionId, WorkflowEvent workflowEvent)
    {
        if (workflowEvent is not (ExecutorInvokedEvent or AgentResponseEvent))
        {
            return default;
        }
        ActivityContext producer = default;
        if (Sessions.TryGetValue(sessionId, out Session? session))
        {
            lock (session)
            {
                if (workflowEvent is ExecutorInvokedEvent invoked)
                {
                    session.Invoked(invoked.ExecutorId);
                    return default;
                }
                producer = session.Current(((AgentResponseEvent)workflowEvent).ExecutorId);
            }
        }
        if (workflowEvent is AgentResponseEvent response && producer == default)
        {
            MafFidelityEventSource.Log.ExecutorSpanNotFound(response.ExecutorId, sessionId);
        }
        return producer;
    }

    private static ActivityListener Listen()
    {
        var listener = new ActivityListener
        {
            ShouldListenTo = source => source.Name == MafFidelity.WorkflowSourceName,
            Sample = (ref ActivityCreationOptions<ActivityContext> _) => ActivitySamplingResult.None,
            ActivityStarted = Started,
            ActivityStopped = Stopped,
        };
        ActivitySource.AddActivityListener(listener);
        return listener;
    }

    private static void Started(Activity activity)
    {
        if (!activity.OperationName.StartsWith(ExecutorProcess, StringComparison.Ordinal))
        {
            return;
        }
        // The executor id is tagged just after the span starts: its name says it already.
        string executorId = activity.OperationName.Substring(ExecutorProcess.Length).Trim();
        if (executorId.Length == 0 || SessionOf(activity.Parent) is not (string sessionId, Activity run))
        {
            return;
        }
        Session session = Sessions.GetOrAdd(sessionId, id => new Session(Begun(run) >= ListeningSince, id));
        lock (session)
        {
            session.Started(executorId, activity.Context);
        }
    }

    private static void Stopped(Activity activity)
    {
        // A session ends when its run is disposed: nothing of it is read after that.
        if (activity.OperationName == WorkflowSession && activity.GetTagItem(SessionIdTag) is string sessionId)
        {
            Sessions.TryRemove(sessionId, out _);
        }
    }

    /// <summary>The session id MAF's run span above an executor span carries, and that run span.</summary>
    private static (string, Activity)? SessionOf(Activity? activity)
    {
        for (; activity is not null; activity = activity.Parent)
        {
            if (activity.Source.Name == MafFidelity.WorkflowSourceName && activity.GetTagItem(SessionIdTag) is string id)
            {
                return (id, activity);
            }
        }
        return null;
    }

    /// <summary>When the session of a run span began: its <c>workflow.session</c> span's start, else the run's.</summary>
    private static DateTime Begun(Activity run)
    {
        for (Activity? above = run; above is not null; above = above.Parent)
        {
            if (above.OperationName == WorkflowSession)
            {
                return above.StartTimeUtc;
            }
        }
        return run.StartTimeUtc;
    }

    /// <summary>
    /// One session's executor spans not yet announced to its reader, and the ones being read.
    /// Not followed: it began before the listener, whose count would be off (reported once, as it is met).
    /// </summary>
    private sealed class Session
    {
        private readonly bool followed;

        public Session(bool followed, string sessionId)
        {
            this.followed = followed;
            if (!followed)
            {
                MafFidelityEventSource.Log.SessionNotFollowed(sessionId);
            }
        }

        private readonly Dictionary<string, Queue<ActivityContext>> _started = new(StringComparer.Ordinal);
        private readonly Dictionary<string, ActivityContext> _current = new(StringComparer.Ordinal);

        public void Started(string executorId, ActivityContext span)
        {
            if (!this.followed)
            {
                return;
            }
            if (!this._started.TryGetValue(executorId, out Queue<ActivityContext>? spans))
            {
                this._started[executorId] = spans = new Queue<ActivityContext>();
            }
            spans.Enqueue(span);
        }

        public void Invoked(string executorId)
        {
            ActivityContext span = this._started.TryGetValue(executorId, out Queue<ActivityContext>? spans)
                && spans.Count > 0 ? spans.Dequeue() : default;
            this._current[executorId] = span;
        }

        public ActivityContext Current(string executorId) =>
            this._current.TryGetValue(executorId, out ActivityContext span) ? span : default;
    }
}
