"""What the divergence costs (docs/outputs.md "Spend"): each unit's framework and truth totals priced,
and the spend the framework did not report. Pure: the prices come from a :class:`Pricer` the caller
passes in (the collector's is :mod:`collector.outputs.pricing`), so the reconciler imports no price data.

An unknown price is ``None`` with the reason said, never 0: a unit whose model nobody can price
is counted apart in the run's sums, not summed as free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from collector.core.model import Evidence, ExecutorVerdict, RunSpend, UnitCost, Usage

#: USD figures are kept to a billionth of a dollar (sums of floats otherwise show 1e-19 residue).
_DIGITS = 9


@dataclass(slots=True)  # not frozen: one is made per chat call of every run (frozen: 2.5x the cost)
class Quote:
    """One price: ``usd`` None when unknown, ``by`` what priced it or why nobody could. A pricer may
    hand out the same Quote for every call it cannot price: never change one."""

    usd: float | None
    by: str


class Pricer(Protocol):
    def __call__(self, model: str | None, provider: str | None, usage: Usage, at_ns: int | None) -> Quote:
        """The price of ``usage`` on ``model`` served by ``provider``, at ``at_ns`` (Unix ns; None: now)."""


def price_unit(evidence: Evidence, pricer: Pricer) -> UnitCost:
    """A unit's cost: the truth priced call by call (each call's own model and time), the framework's
    total priced with the model its calls used (one model: the ledger does not split its total by
    model), and the unreported spend (truth - framework) where the framework under-reported.

    One pass over the calls (this runs for every unit of every run)."""
    truth: float | None = 0.0
    unknown: list[str] = []  # why a figure is unknown, in order
    pairs: set[tuple[str | None, str | None]] = set()
    by: set[str] = set()
    first: int | None = None  # the first priced call's time: the framework total is priced then
    for c in evidence.chat_calls:
        usage = c.usage
        if usage.total is None:
            continue
        pairs.add((c.model, c.provider))
        if (seq := c.seq) and (first is None or seq < first):
            first = seq
        quote = pricer(c.model, c.provider, usage, seq or None)
        by.add(quote.by)
        if quote.usd is None:
            truth = None
            unknown.append(quote.by)
        elif truth is not None:
            truth += quote.usd
    if pairs:
        truth = None if truth is None else _round(truth)
    else:  # no call reported its tokens: free where every call failed (no tokens, nothing spent)
        truth = 0.0 if evidence.truth_tokens == 0 else None
    models = sorted(pairs, key=str) if len(pairs) > 1 else list(pairs)
    named = _name(*models[0]) if len(models) == 1 else ", ".join([_name(m, p) for m, p in models]) or None
    framework = None
    if not evidence.ledger_missing:
        if len(models) == 1:
            model, provider = models[0]
            usage = Usage(evidence.framework_input_tokens, evidence.framework_output_tokens, evidence.framework_tokens)
            quote = pricer(model, provider, usage, first)
            if quote.usd is None:
                unknown.append(quote.by)
            else:
                framework = _round(quote.usd)
        elif models:
            unknown.append(f"its calls used {len(models)} models ({named}); the framework's total is not split "
                           "by model, so its price is unknown")
    tokens = None if evidence.delta is None else max(-evidence.delta, 0)
    unreported = None
    if tokens == 0:
        unreported = 0.0
    elif tokens is not None and truth is not None and framework is not None:
        unreported = _round(max(truth - framework, 0.0))
    if truth is None and not pairs:
        unknown.append("no chat call of the unit reported its tokens")
    priced_by = None
    if by and truth is not None:
        priced_by = next(iter(by)) if len(by) == 1 else "; ".join(sorted(by))
    # positional, in field order (per unit of every run: 7 keywords take 2.5x the call)
    return UnitCost(named, framework, truth, unreported, tokens, priced_by,
                    unknown[0] if len(unknown) == 1 else "; ".join(dict.fromkeys(unknown)) or None)


def run_spend(units: Iterable[ExecutorVerdict]) -> RunSpend:
    """The run's spend: each figure summed over the units that have it; a unit whose truth could
    not be priced is counted in ``units_unknown``, never summed as 0."""
    costs = [u.evidence.cost for u in units if u.evidence.cost is not None]
    return RunSpend(
        framework_usd=_round(sum(c.framework_usd for c in costs if c.framework_usd is not None)),
        truth_usd=_round(sum(c.truth_usd for c in costs if c.truth_usd is not None)),
        unreported_usd=_round(sum(c.unreported_usd for c in costs if c.unreported_usd is not None)),
        unreported_tokens=sum(c.unreported_tokens for c in costs if c.unreported_tokens is not None),
        units_priced=sum(c.truth_usd is not None for c in costs),
        units_unknown=sum(c.truth_usd is None for c in costs),
    )


def price_units(units: Sequence[ExecutorVerdict], pricer: Pricer) -> RunSpend:
    """Each unit's evidence given its cost, and the run's spend."""
    for unit in units:
        unit.evidence.cost = price_unit(unit.evidence, pricer)
    return run_spend(units)


def _name(model: str | None, provider: str | None) -> str:
    return f"{model or '(no model)'} ({provider})" if provider else model or "(no model)"


def _round(usd: float) -> float:
    return round(usd, _DIGITS)
