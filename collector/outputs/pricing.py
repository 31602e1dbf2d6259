"""Prices for :mod:`collector.core.spend`: the config's per-model overrides, else the price data bundled
in ``genai-prices`` (docs/outputs.md "Spend").

Only the bundled snapshot is read: genai-prices fetches newer data only when asked to
(``UpdatePrices``), which this module never does, so pricing makes no network call.
"""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import genai_prices
from genai_prices import data_snapshot
from genai_prices.types import TieredPrices

from collector.config import Pricing as PricingConfig
from collector.core.model import Usage
from collector.core.spend import Quote

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
_SOURCE = f"genai-prices {genai_prices.__version__}"


class Pricing:
    """The collector's :class:`~collector.core.spend.Pricer`.

    genai-prices' own calculation takes about a millisecond a call (it decomposes the usage into every
    unit it knows), too slow for every chat call of every run. A price without token tiers is affine
    in the input and output tokens, so each such price (one object per model and date in genai-prices'
    data) is calculated by genai-prices three times, at no tokens and at a million of each, and applied
    as those rates; a tiered price (a rate that changes past a prompt size) is calculated per call.
    """

    def __init__(self, config: PricingConfig) -> None:
        self.overrides = {name.casefold(): (name, rate) for name, rate in config.models.items()}
        #: (model, genai-prices provider id) -> (provider, model) found, or why none was.
        self._found: dict[tuple[str, str | None], tuple[Any, Any] | str] = {}
        #: id(model price) -> (the price, kept so its id stays its own; per call, per input and output
        #: token in USD), or None for a tiered price.
        self._rates: dict[int, tuple[Any, Decimal, Decimal, Decimal] | None] = {}

    def __call__(self, model: str | None, provider: str | None, usage: Usage, at_ns: int | None) -> Quote:
        if not model:
            return Quote(None, "no model is named on its chat calls (gen_ai.response.model / gen_ai.request.model)")
        fix = f"add {model} under pricing.models in the config (0 for a self-hosted model)"
        named = self.overrides.get(model.casefold())
        if named is not None and named[1].provider in (None, provider):
            key, rate = named
            if usage.input_tokens is None and usage.output_tokens is None and usage.total_tokens:
                return Quote(None, f"{model}: a total without its input/output split cannot be priced")
            usd = ((usage.input_tokens or 0) * rate.input_per_mtok
                   + (usage.output_tokens or 0) * rate.output_per_mtok) / 1e6
            return Quote(usd, f"pricing.models.{key}")
        if usage.input_tokens is None and usage.output_tokens is None:
            if usage.total_tokens:
                return Quote(None, f"{model}: a total without its input/output split cannot be priced")
            return Quote(0.0, _SOURCE)
        where = (provider or "").casefold()
        if where in SELF_HOSTED:
            return Quote(None, f"{model} is served by {provider} (self-hosted), which has no published price: {fix}")
        provider_id = PROVIDERS.get(where, where) or None
        if provider_id is not None and provider_id not in _KNOWN:
            return Quote(None, f"genai-prices {genai_prices.__version__} has no prices for provider {provider!r} "
                               f"(model {model}): {fix}")
        found = self._find(model, provider_id)
        if isinstance(found, str):
            on = f" from {provider}" if provider else ""
            hint = " (a span that names an Azure OpenAI deployment, not its model)" if provider_id == "azure" else ""
            return Quote(None, f"{found}{on}{hint}: {fix}")
        seller, info = found
        when = _when(at_ns)
        rates = self._rates_of(seller, info, when)
        tokens = {"input_tokens": usage.input_tokens or 0, "output_tokens": usage.output_tokens or 0}
        if rates is None:
            usd = info.calc_price(genai_prices.Usage(**tokens), seller, genai_request_timestamp=when).total_price
        else:
            usd = rates[1] + rates[2] * tokens["input_tokens"] + rates[3] * tokens["output_tokens"]
        return Quote(float(usd), f"{_SOURCE}: {seller.id} {info.id}")

    def _find(self, model: str, provider_id: str | None) -> tuple[Any, Any] | str:
        key = (model, provider_id)
        found = self._found.get(key)
        if found is None:
            try:
                found = _SNAPSHOT.find_provider_model(model, None, provider_id, None)
            except LookupError:
                found = f"genai-prices {genai_prices.__version__} does not know model {model!r}"
            self._found[key] = found
        return found

    def _rates_of(self, seller: Any, info: Any, when: datetime | None) -> tuple[Any, Decimal, Decimal, Decimal] | None:
        price = info.get_prices(when or datetime.now(timezone.utc))
        if id(price) not in self._rates:
            if any(isinstance(v, TieredPrices) for v in vars(price).values()):
                self._rates[id(price)] = None
            else:
                def total(input_tokens: int, output_tokens: int) -> Decimal:
                    usage = genai_prices.Usage(input_tokens=input_tokens, output_tokens=output_tokens)
                    return info.calc_price(usage, seller, genai_request_timestamp=when).total_price

                base = total(0, 0)
                self._rates[id(price)] = (price, base, (total(_MILLION, 0) - base) / _MILLION,
                                          (total(0, _MILLION) - base) / _MILLION)
        return self._rates[id(price)]


def _when(at_ns: int | None) -> datetime | None:
    """A call's start as the price date (prices change); None (now) when unknown or not a plausible time."""
    if at_ns is None or not 0 < at_ns < 2**63:
        return None
    return datetime.fromtimestamp(at_ns / 1e9, timezone.utc)
