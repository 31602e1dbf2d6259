"""The ledger join (docs/verdicts.md "Which run a ledger belongs to"): which run, and which unit of
it, each workflow-event ledger span belongs to. A ledger span recorded in a run under its executor's
span is that executor's own agent's; one recorded beside the runs (by the caller: MAF .NET's workflow
events read without their run, the seed's hand-built traces) joins the one run it can only belong
to, by identity, never by time, or none."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from collector.core.model import Announcement, LedgerEntry
from collector.core.units import Run

#: A ledger span beside every run, naming only its executor: (its parent span id, the executor key,
#: the executor id as named, case-folded, the entry, what it announced).
CallerLedger = tuple[bytes, str, str, LedgerEntry, Announcement | None]
#: A unit's key in its run: (executor key, agent key).
UnitKey = tuple[str | None, str | None]


@dataclass(slots=True)
class Joins:
    """Callers' ledger spans as one publication shares them out (:func:`share_out`)."""

    #: Run key -> (executor key, entry) of the spans that joined it.
    joined: dict[str | None, list[tuple[str, LedgerEntry]]]
    #: Executor key -> how many ledger spans naming it joined no run.
    unjoined: dict[str, int]
    #: Executors named by unjoined spans that no run of the trace ran.
    stray: tuple[str, ...]
    #: Executor key -> what the first ledger span naming it announced (the package, its MAF release),
    #: joined or not: a run whose ledger could not be joined still says which package recorded it.
    said: dict[str, Announcement]


NO_JOINS = Joins({}, {}, (), {})


def share_out(callers: Iterable[CallerLedger], runs: dict[str | None, Run], outside: dict[bytes, bytes],
              waiting: Iterable[str], last: dict[str | None, tuple[object, ...]]) -> Joins:
    """Callers' ledger spans by the run each joins: the one run beneath its parent (directly, or
    through spans outside every run, ``outside``: child -> parent, as .NET's ``workflow.session``) that
    ran its executor, the same agent instance where the executor id names one (MAF .NET's
    ``{Name}_{Id}``). Where several runs could own it, or none, or its own parent has not arrived (the
    executors of such spans still ``waiting`` for theirs), it joins none and its executor's units are
    NoTruth ``ledger_unjoined``: never a guess, never by time. Worked out anew from every span known at
    each publication, so arrival order changes nothing: a run whose share differs from what it was
    ``last`` published with is marked dirty (published again), and ``last`` updated."""
    joined: dict[str | None, list[tuple[str, LedgerEntry]]] = defaultdict(list)
    unjoined: dict[str, int] = defaultdict(int)
    announced: dict[str, Announcement] = {}
    for parent_id, executor, named, entry, said in callers:
        if said is not None:
            announced.setdefault(executor, said)
        owners = [key for key, r in runs.items()
                  if r.span_id is not None and executor in r.executors and parent_id in _above(r, outside)
                  and named in (r.executors[executor].instances or (named,))]
        if len(owners) == 1:
            joined[owners[0]].append((executor, entry))
        else:
            unjoined[executor] += 1
    for executor in waiting:  # not yet classified: which run's is not known yet
        unjoined[executor] += 1
    stray = tuple(sorted(e for e in unjoined if not any(e in r.executors for r in runs.values())))
    for key, run in runs.items():
        share = (tuple(sorted(entry.span_id or "" for _, entry in joined.get(key, ()))),
                 tuple(sorted((e, n) for e, n in unjoined.items() if e in run.executors)), stray)
        if last.get(key) != share:
            last[key] = share
            run.dirty = True
    return Joins(joined, unjoined, stray, announced)


def _above(run: Run, outside: dict[bytes, bytes]) -> set[bytes]:
    """The run's parent and, above it, every ancestor outside all runs (cycles cut)."""
    above: set[bytes] = set()
    span_id = run.parent_id
    while span_id and span_id not in above:
        above.add(span_id)
        span_id = outside.get(span_id, b"")
    return above


def _own_unit(run: Run, executor: str, own: dict[str, str]) -> UnitKey:
    """The unit of an executor's own agent: the agent named as the executor (by the executor's id, or
    by the agent ``own`` says the id was made from), else the one agent that ran there; (executor,
    None) where that cannot be told."""
    named = own.get(executor, executor)
    agents = [a for e, a in run.units if e == executor and a is not None]
    mine = [a for a in agents if a == named] or agents
    return (executor, mine[0]) if len(mine) == 1 else (executor, None)


def _by_instance(run: Run, executor: str, entries: list[LedgerEntry],
                 instances: dict[str, str]) -> dict[UnitKey, list[LedgerEntry]] | None:
    """Where several agents ran directly in executors of one name (MAF .NET gives ``code_writer`` and
    ``code-writer`` both ``code_writer_{Id}``), each event goes to the agent of the instance it names;
    None where one agent did."""
    owners = {instance: (executor, agent) for (e, agent), unit in run.units.items()
              if e == executor and agent is not None and unit.instances for instance in unit.instances}
    if len(set(owners.values())) < 2:
        return None
    out: dict[UnitKey, list[LedgerEntry]] = defaultdict(list)
    for entry in entries:
        out[owners.get(instances.get(entry.span_id or "", ""), (executor, None))].append(entry)
    return out


def event_ledgers(run: Run, joins: Joins, own: dict[str, str],
                  instances: dict[str, str]) -> tuple[dict[UnitKey, list[LedgerEntry]], dict[UnitKey, int]]:
    """Per unit, the workflow-event ledger entries it holds: a ledger span that names only its executor
    (recorded in the run under the executor's span, or joined from beside the run) is that executor's
    own agent's (``own``: executor -> the agent its id names, where their keys differ), so one unit
    holds the entry and the agent's spans and the entry, the framework's own ledger, is what is
    compared (``instances``: the instance each event names, where two agents share the executor's
    name). And per unit, the ledger spans of its executor that joined no run."""
    by_executor: dict[str, list[LedgerEntry]] = defaultdict(list)
    for (executor, agent), unit in run.units.items():
        if agent is None and executor is not None and unit.ledger:
            by_executor[executor] += unit.ledger
    for executor, entry in joins.joined.get(run.span_id, ()):
        by_executor[executor].append(entry)
    events: dict[UnitKey, list[LedgerEntry]] = {}
    for executor, entries in by_executor.items():
        routed = _by_instance(run, executor, entries, instances)
        if routed is None:
            events[_own_unit(run, executor, own)] = entries
        else:
            events.update(routed)
    return events, {_own_unit(run, e, own): n for e, n in joins.unjoined.items() if e in run.executors}


def reports(entry: LedgerEntry) -> bool:
    """The framework reported something for this response: tokens or a finish reason."""
    return bool(entry.usage.total) or entry.finish_reason is not None
