"""What the divergence costs (docs/outputs.md "Spend"): each unit's framework and truth totals priced,
and the spend the framework did not report. Pure: the prices come from a :class:`Pricer` the caller
passes in (the collector's is :mod:`collector.outputs.pricing`), so the reconciler imports no price data.

An unknown price is ``None`` with the reason said, never 0: a unit whose model nobody can price
is counted apart in the run's sums, not summed as free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, final

from collector.core.model import Evidence, ExecutorVerdict, RunSpend, UnitCost, Usage

#: USD figures are kept to a billionth of a dollar (sums of floats otherwise show 1e-19 residue).
_DIGITS = 9


@final  # pricers tell a Quote from Rates with `type(x) is`, which a subclass would defeat
@dataclass(slots=True)  # not frozen: one is made per chat call of every run (frozen: 2.5x the cost)
class Quote:
    """One price: ``usd`` None when unknown, ``by`` what priced it or why nobody could. A pricer may
    hand out the same Quote for every call it cannot price: never change one."""

    usd: float | None
    by: str


@final
@dataclass(frozen=True, slots=True)
class Rates:
    """A price affine in the tokens, as a pricer looked it up once for many calls: ``usd`` of a call
    is ``(base + input * per_input + output * per_output) / divisor`` (rates per token with a
    divisor of 1, or per million tokens divided last, as a config states them)."""

    base: float
    per_input: float
    per_output: float
    divisor: float
    by: str

    def usd(self, input_tokens: int, output_tokens: int) -> float:
        return (self.base + self.per_input * input_tokens + self.per_output * output_tokens) / self.divisor


class Pricer(Protocol):
    """What prices a unit's calls: :meth:`rates` for most of them, :meth:`__call__` for the rest."""

    def __call__(self, model: str | None, provider: str | None, usage: Usage, at_ns: int | None) -> Quote:
        """The price of ``usage`` on ``model`` served by ``provider``, at ``at_ns`` (Unix ns; None: now)."""
        ...

    def rates(self, model: str | None, provider: str | None, at_ns: int | None) -> Rates | Quote | None:
        """What prices a call of ``model`` from ``provider`` at ``at_ns`` that reports its input and
        output tokens: rates, one Quote for any such call (an unknown price), or None: ask
        :meth:`__call__` for each call (a price that is not affine in the tokens)."""
        ...


def price_unit(evidence: Evidence, pricer: Pricer) -> UnitCost:
    """A unit's cost: the truth priced call by call (each call's own model and time), the framework's
    total priced with the model its calls used (one model: the ledger does not split its total by
    model), and the unreported spend (truth - framework) where the framework under-reported.

    One pass over the calls, asking the pricer for rates, not a Quote per call: this runs for every
    call of every run (a Quote per call took ~15% longer)."""
    truth: float | None = 0.0
    unknown: list[str] = []  # why a figure is unknown, in order
    pairs: set[tuple[str | None, str | None]] = set()  # the calls' (model, provider)
    by: set[str] = set()  # what priced them, or why nothing could
    first: int | None = None  # the first priced call's time: the framework total is priced then
    for c in evidence.chat_calls:
        usage = c.usage
        input_tokens, output_tokens = usage.input_tokens, usage.output_tokens
        if input_tokens is None and output_tokens is None and usage.total_tokens is None:  # no tokens: not priced
            continue
        model, provider, seq = c.model, c.provider, c.seq
        pairs.add((model, provider))
        if seq and (first is None or seq < first):
            first = seq
        usd, how = _priced(pricer, model, provider, seq or None, input_tokens, output_tokens, usage.total_tokens)
        if usd is None:
            truth = None
            unknown.append(how)
        elif truth is not None:
            truth += usd
        by.add(how)
    if not pairs:  # no call reported its tokens: free where every call failed (no tokens, nothing spent)
        truth = 0.0 if evidence.truth_tokens == 0 else None
    elif truth is not None:
        truth = _round(truth)
    models = sorted(pairs, key=str) if len(pairs) > 1 else list(pairs)
    named = _name(*models[0]) if len(models) == 1 else ", ".join([_name(m, p) for m, p in models]) or None
    framework = None
    if not evidence.ledger_missing:
        if len(models) == 1:
            model, provider = models[0]
            usd, how = _priced(pricer, model, provider, first, evidence.framework_input_tokens,
                               evidence.framework_output_tokens, evidence.framework_tokens)
            if usd is None:
                unknown.append(how)
            else:
                framework = _round(usd)
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


def _priced(pricer: Pricer, model: str | None, provider: str | None, at_ns: int | None, input_tokens: int | None,
            output_tokens: int | None, total_tokens: int | None) -> tuple[float | None, str]:
    """The price of one call's (or a ledger's) tokens and what priced it: by the pricer's rates where
    it has them and the tokens are split into input and output, else by a Quote."""
    rates = pricer.rates(model, provider, at_ns) if input_tokens is not None or output_tokens is not None else None
    if type(rates) is Rates:
        return rates.usd(input_tokens or 0, output_tokens or 0), rates.by
    quote = (rates if type(rates) is Quote
             else pricer(model, provider, Usage(input_tokens, output_tokens, total_tokens), at_ns))
    return quote.usd, quote.by


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


#: A run's spend figures, each summed over the units that have it.
SPEND_FIGURES = ("framework_usd", "truth_usd", "unreported_usd", "unreported_tokens")


def known_spend(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """A run document's spend as it may be shown: each of :data:`SPEND_FIGURES` None where no unit
    has it (a run without a ledger has no framework price, one that compared nothing no unreported
    spend): an empty sum is unknown, never 0. The unreported USD is known where a unit that
    under-reported has a price (a unit that reported every token adds $0 whatever its model costs).
    None for a run that was not priced."""
    spend = doc.get("spend")
    if spend is None:
        return None
    costs = [cost for unit in doc["executors"] if (cost := unit["evidence"].get("cost"))]
    under = [c for c in costs if c["unreported_tokens"]] or costs
    return {**spend, **{f: spend[f] if any(c[f] is not None for c in (under if f == "unreported_usd" else costs))
                        else None for f in SPEND_FIGURES}}


def price_units(units: Sequence[ExecutorVerdict], pricer: Pricer) -> RunSpend:
    """Each unit's evidence given its cost, and the run's spend."""
    for unit in units:
        unit.evidence.cost = price_unit(unit.evidence, pricer)
    return run_spend(units)


def _name(model: str | None, provider: str | None) -> str:
    return f"{model or '(no model)'} ({provider})" if provider else model or "(no model)"


def _round(usd: float) -> float:
    return round(usd, _DIGITS)
