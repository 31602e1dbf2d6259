"""Prices for :mod:`collector.core.spend`: the config's per-model overrides, else the price data bundled
in ``genai-prices`` (docs/outputs.md "Spend").

Only the bundled snapshot is read: genai-prices fetches newer data only when asked to
(``UpdatePrices``), which this module never does, so pricing makes no network call.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import genai_prices
from genai_prices import data_snapshot
from genai_prices.types import TieredPrices

from collector.config import Pricing as PricingConfig
from collector.core.model import Usage
from collector.core.spend import Quote, Rates

#: ``gen_ai.provider.name`` / ``gen_ai.system`` values (OpenTelemetry GenAI conventions, and older
#: spellings) -> genai-prices provider ids. A provider that is already a genai-prices id needs no entry.
PROVIDERS = {
    "azure.ai.openai": "azure", "az.ai.openai": "azure", "azure_openai": "azure",
    "azure.ai.inference": "azure", "az.ai.inference": "azure",
    "aws.bedrock": "aws", "bedrock": "aws",
    "gcp.gemini": "google", "gcp.vertex_ai": "google", "gcp.gen_ai": "google", "gemini": "google",
    "vertex_ai": "google",
    "mistral_ai": "mistral", "x_ai": "x-ai", "xai": "x-ai",
}
#: Providers that serve models on the user's own hardware: no published price applies (a hosted
#: provider's price for a model of the same name would be wrong), so only an override prices them.
SELF_HOSTED = frozenset({"ollama", "vllm", "llama.cpp", "lmstudio", "foundry_local", "onnx", "localai"})
#: The price data bundled with the installed genai-prices (never an updated snapshot: see the module docstring).
_SNAPSHOT = data_snapshot.get_snapshot()
_KNOWN = frozenset(p.id for p in _SNAPSHOT.providers)
_MILLION = 1_000_000
_MINUTE = 60 * 10**9
#: (model, provider, minute) entries kept before the cache starts again (a minute of calls needs a few).
_MAX_CACHED = 10_000
_NO_MODEL = Quote(None, "no model is named on its chat calls (gen_ai.response.model / gen_ai.request.model)")
_SOURCE = f"genai-prices {genai_prices.__version__}"


class Pricing:
    """The collector's :class:`~collector.core.spend.Pricer`.

    genai-prices' own calculation takes about a millisecond a call (it decomposes the usage into every
    unit it knows), too slow for every chat call of every run. A price without token tiers is affine
    in the input and output tokens, so each such price (one object per model and date in genai-prices'
    data) is calculated by genai-prices three times, at no tokens and at a million of each, and applied
    as those rates; a tiered price (a rate that changes past a prompt size) is calculated per call.
    What applies to a model is looked up once a minute of call times (prices change by date, a few by
    time of day).
    """

    def __init__(self, config: PricingConfig) -> None:
        self.overrides = {name.casefold(): (name, rate) for name, rate in config.models.items()}
        #: (model, provider, minute) -> its rates (per token, or the config's per million tokens),
        #: genai-prices' calculation per call (a tiered price: seller, model info, what priced it), or
        #: the unknown price with its reason. Looked up once; each call is then a dict get and a
        #: multiply-add (this runs for every chat call of every run).
        self._by_minute: dict[tuple[str, str | None, int], Rates | Quote | tuple[Any, Any, str]] = {}
        #: id(model price) -> (the price, kept so its id stays its own; its rates), rates None when tiered.
        self._rates: dict[int, tuple[Any, tuple[float, float, float] | None]] = {}

    def __call__(self, model: str | None, provider: str | None, usage: Usage, at_ns: int | None) -> Quote:
        if not model:
            return _NO_MODEL
        input_tokens, output_tokens = usage.input_tokens, usage.output_tokens
        if input_tokens is None and output_tokens is None:
            return self._unsplit(model, usage)
        input_tokens, output_tokens = input_tokens or 0, output_tokens or 0
        minute = _minute(at_ns)
        found = self._entry(model, provider, minute)
        if type(found) is Quote:
            return found
        if type(found) is Rates:
            return Quote(found.usd(input_tokens, output_tokens), found.by)
        seller, info, by = found  # tiered
        usd = info.calc_price(genai_prices.Usage(input_tokens=input_tokens, output_tokens=output_tokens),
                              seller, genai_request_timestamp=_time(minute)).total_price
        return Quote(float(usd), by)

    def rates(self, model: str | None, provider: str | None, at_ns: int | None) -> Rates | Quote | None:
        if not model:
            return _NO_MODEL
        found = self._entry(model, provider, _minute(at_ns))
        return None if isinstance(found, tuple) else found

    def _entry(self, model: str, provider: str | None, minute: int) -> Rates | Quote | tuple[Any, Any, str]:
        found = self._by_minute.get((model, provider, minute))
        if found is None:
            if len(self._by_minute) >= _MAX_CACHED:
                self._by_minute.clear()
            found = self._by_minute[model, provider, minute] = self._price(model, provider, minute)
        return found

    def _unsplit(self, model: str, usage: Usage) -> Quote:
        """A call that reported no input/output split: free when it reported no tokens at all."""
        if usage.total_tokens:
            return Quote(None, f"{model}: a total without its input/output split cannot be priced")
        named = self.overrides.get(model.casefold())
        return Quote(0.0, f"pricing.models.{named[0]}" if named else _SOURCE)

    def _price(self, model: str, provider: str | None, minute: int) -> Rates | Quote | tuple[Any, Any, str]:
        """What prices ``model`` from ``provider`` in that minute (an entry of :attr:`_by_minute`):
        the config's override (whatever the minute), genai-prices' price of that date, or why nothing can."""
        named = self.overrides.get(model.casefold())
        if named is not None and named[1].provider in (None, provider):
            key, rate = named
            return Rates(0.0, rate.input_per_mtok, rate.output_per_mtok, _MILLION, f"pricing.models.{key}")
        fix = f"add {model} under pricing.models in the config (0 for a self-hosted model)"
        where = (provider or "").casefold()
        if where in SELF_HOSTED:
            return Quote(None, f"{model} is served by {provider} (self-hosted), which has no published price: {fix}")
        provider_id = PROVIDERS.get(where, where) or None
        if provider_id is not None and provider_id not in _KNOWN:
            return Quote(None, f"genai-prices {genai_prices.__version__} has no prices for provider {provider!r} "
                               f"(model {model}): {fix}")
        try:
            seller, info = _SNAPSHOT.find_provider_model(model, None, provider_id, None)
        except LookupError:
            on = f" from {provider}" if provider else ""
            hint = " (a span that names an Azure OpenAI deployment, not its model)" if provider_id == "azure" else ""
            return Quote(None, f"genai-prices {genai_prices.__version__} does not know model {model!r}{on}{hint}: "
                               f"{fix}")
        when = _time(minute)
        price = info.get_prices(when)
        if id(price) not in self._rates:
            rates = None
            if not any(isinstance(v, TieredPrices) for v in vars(price).values()):
                def total(input_tokens: int, output_tokens: int) -> Decimal:
                    usage = genai_prices.Usage(input_tokens=input_tokens, output_tokens=output_tokens)
                    return info.calc_price(usage, seller, genai_request_timestamp=when).total_price

                base = total(0, 0)
                rates = (float(base), float((total(_MILLION, 0) - base) / _MILLION),
                         float((total(0, _MILLION) - base) / _MILLION))
            self._rates[id(price)] = (price, rates)
        rates = self._rates[id(price)][1]
        by = f"{_SOURCE}: {seller.id} {info.id}"
        return (seller, info, by) if rates is None else Rates(*rates, 1.0, by)


def _minute(at_ns: int | None) -> int:
    """A call's time (Unix ns; None or out of range: now) as the minute its price is looked up for."""
    return (at_ns if at_ns is not None and 0 < at_ns < 2**63 else time.time_ns()) // _MINUTE


def _time(minute: int) -> datetime:
    """A minute (Unix ns // 60 s) as the price date: prices change by date, a few by time of day."""
    return datetime.fromtimestamp(minute * 60, UTC)
