"""Chat-call de-duplication (docs/design.md §1): one truth entry per model call, however many
instrumentations recorded it. A unit's chat spans arrive as :data:`Turn` tuples; :func:`calls` folds
stacked and side-by-side records of one request into that call."""

from __future__ import annotations

from collections import defaultdict
from typing import Final

from collector.core.model import LayerDisagreement, UnattributedChat, Usage

#: A chat call while its trace is assembled and in the late window: (input, output and total tokens,
#: finish reason, start, invocation, span id bytes, error, model, provider, the span id of the chat
#: span it is beneath in its unit (None: it is outermost), the parts of its counts (cache read, cache
#: write, reasoning; None: none known), its end where another record of the same call could lie beside
#: it (beneath a chat span, or directly under its agent span; else None), its span name): ~100 bytes
#: less than a ChatTurn with its Usage and hex id (the span id is the very object the trace keys the
#: span by; model, provider and span name strings are shared per trace), and a tuple of atoms the
#: garbage collector stops tracking. bench/late_memory.py: 286 -> 194 bytes a span held for agents of
#: 50 chat calls, 425 -> 377 for agents of 3 (before model, provider, outer call, parts, end and name:
#: six references and an end more now).
Turn = tuple[int | None, int | None, int | None, str | None, int, str | None, bytes, str | None, str | None,
              str | None, bytes | None, tuple[int | None, int | None, int | None] | None, int | None, str]
#: Positions in :data:`Turn`.
T_FINISH: Final = 3
T_START: Final = 4
T_INVOCATION: Final = 5
T_SPAN: Final = 6
T_ERROR: Final = 7
T_OUTER: Final = 10
T_PARTS: Final = 11
T_END: Final = 12
T_NAME: Final = 13


def _responded(turn: Turn) -> bool:
    """The turn carries a response of its own: usage or a finish reason."""
    return turn[0] is not None or turn[1] is not None or turn[2] is not None or turn[T_FINISH] is not None


def _tokens(turn: Turn) -> int | None:
    return Usage(*turn[:3]).total


def calls(turns: list[Turn]) -> tuple[list[Turn], int, tuple[LayerDisagreement, ...]]:
    """One truth entry per model call (docs/design.md §1): the unit's turns as calls, how many chat
    spans were folded into a call another records, and where two records of a call disagree.

    A turn beneath another (stacked instrumentations) records that call. The outermost is the call:
    its response is its own where it carries one, else the responses of its nearest records beneath
    (a retried or fallen-back call: each attempt once), never both. A failed call stays failed: what
    its attempts beneath saw without an answer is part of that failure, never a bare request (so
    never the Path-2 gap). Count parts a call lacks are taken from beneath (shown, never counted).
    Records side by side are one (:func:`_side_by_side`): beneath one call, or directly under one
    agent invocation.
    """
    ids = {t[T_SPAN] for t in turns}
    beneath: dict[bytes, list[Turn]] = defaultdict(list)
    for t in turns:
        if (outer := t[T_OUTER]) is not None and outer in ids:
            beneath[outer].append(t)
    disagree: list[tuple[int, LayerDisagreement]] = []  # (the call's start, what disagrees)
    resolved: dict[bytes, list[Turn]] = {}
    # A turn is classified after its parent, so in reverse the records beneath come first.
    for t in reversed(turns):
        inner = beneath.get(t[T_SPAN])
        if not inner:
            resolved[t[T_SPAN]] = [t]
            continue
        records = _side_by_side([(turn, resolved.pop(turn[T_SPAN])) for turn in inner], disagree)
        if _responded(t):
            total = _total(records)
            own = _tokens(t)
            if own is not None and total is not None and total != own:
                disagree.append((t[T_START], LayerDisagreement(t[T_SPAN].hex(), own,
                                                                 tuple(r[T_SPAN].hex() for r in records), total)))
            if t[T_PARTS] is None:
                t = (*t[:T_PARTS], _sum_parts(records), *t[T_END:])
            resolved[t[T_SPAN]] = [t]
        elif t[T_ERROR] is not None:
            resolved[t[T_SPAN]] = [r for r in records if _responded(r) or r[T_ERROR] is not None] or [t]
        else:
            resolved[t[T_SPAN]] = records
    found: list[Turn] = []
    direct: dict[str | None, list[tuple[Turn, list[Turn]]]] = defaultdict(list)
    for t in turns:
        if t[T_SPAN] in resolved:
            if t[T_END] is None:
                found += resolved[t[T_SPAN]]
            else:  # directly under its agent span
                direct[t[T_INVOCATION]].append((t, resolved[t[T_SPAN]]))
    for pairs in direct.values():
        found += _side_by_side(pairs, disagree) if len(pairs) > 1 else pairs[0][1]
    disagree.sort(key=lambda seen: (seen[0], seen[1].span_id or ""))  # the same in any arrival order
    return found, len(turns) - len(found), tuple(layers for _, layers in disagree)


def _total(records: list[Turn]) -> int | None:
    """The token total of a call's records (failed attempts add 0); None where a response or a record
    without one has no count."""
    totals = [_tokens(r) for r in records if _responded(r) or r[T_ERROR] is None]
    known = [total for total in totals if total is not None]
    return sum(known) if known and len(known) == len(totals) else None


def _side_by_side(pairs: list[tuple[Turn, list[Turn]]], disagree: list[tuple[int, LayerDisagreement]]
                  ) -> list[Turn]:
    """Sibling records (each turn with what it resolved to) as calls, two records of one request once.

    One call's attempts follow one another, and an agent's model calls too: sibling chat spans whose
    times overlap and whose names differ are two instrumentations of one request (Anthropic's SDK's
    span beside OpenLLMetry's `anthropic.chat`), counted once: the one that says most (a token count
    and a finish reason, else a token count, else a response; the first such). Same-named spans side
    by side stay apart (a client's concurrent calls each get their own span: merging them would
    under-count the truth)."""
    pairs.sort(key=lambda pair: pair[0][T_START])
    out: list[Turn] = []
    group: list[tuple[Turn, list[Turn]]] = []
    group_end = -1
    for pair in pairs:
        turn = pair[0]
        if group and turn[T_START] < group_end and all(turn[T_NAME] != g[0][T_NAME] for g in group):
            group.append(pair)
        else:
            if group:
                out += _one_record(group, disagree)
            group, group_end = [pair], -1
        if (end := turn[T_END]) is not None and end > group_end:
            group_end = end
    if group:
        out += _one_record(group, disagree)
    return out


def _one_record(group: list[tuple[Turn, list[Turn]]], disagree: list[tuple[int, LayerDisagreement]]
                ) -> list[Turn]:
    """One request's records side by side: the one that counts, and any other total that differs."""
    if len(group) == 1:
        return group[0][1]
    chosen = (next((p for p in group if any(_tokens(r) is not None and r[T_FINISH] is not None for r in p[1])), None)
              or next((p for p in group if any(_tokens(r) is not None for r in p[1])), None)
              or next((p for p in group if any(_responded(r) for r in p[1])), group[0]))
    total = _total(chosen[1])
    for other in group:
        theirs = _total(other[1]) if other is not chosen else None
        if total is not None and theirs is not None and theirs != total:
            disagree.append((chosen[0][T_START], LayerDisagreement(
                chosen[0][T_SPAN].hex(), total, tuple(r[T_SPAN].hex() for r in other[1]), theirs)))
    return chosen[1]


def _sum_parts(records: list[Turn]) -> tuple[int | None, int | None, int | None] | None:
    known = [parts for r in records if (parts := r[T_PARTS]) is not None]
    if not known:
        return None
    read, write, reasoning = ([v for p in known if (v := p[n]) is not None] for n in range(3))
    return (sum(read) if read else None, sum(write) if write else None, sum(reasoning) if reasoning else None)


def unattributed_chat(executor: str | None, turns: list[Turn]) -> UnattributedChat:
    totals = [Usage(i, o, t).total for i, o, t, *_ in turns]
    known = [total for total in totals if total is not None]
    return UnattributedChat(executor, len(turns), sum(known) if known else None)
