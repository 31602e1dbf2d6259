"""Prices for :mod:`collector.core.spend`: the config's per-model overrides, else the price data bundled
in ``genai-prices`` (docs/outputs.md "Spend").

Only the bundled snapshot is read: genai-prices fetches newer data only when asked to
(``UpdatePrices``), which this module never does, so pricing makes no network call.
"""

from __future__ import annotations

from datetime import datetime, timezone

import genai_prices
from genai_prices import calc_price

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
_KNOWN = frozenset(p.id for p in genai_prices.data_snapshot.get_snapshot().providers)
_SOURCE = f"genai-prices {genai_prices.__version__}"


class Pricing:
    """The collector's :class:`~collector.core.spend.Pricer`."""

    def __init__(self, config: PricingConfig) -> None:
        self.overrides = {name.casefold(): (name, rate) for name, rate in config.models.items()}

    def __call__(self, model: str | None, provider: str | None, usage: Usage, at_ns: int | None) -> Quote:
        if not model:
            return Quote(None, "no model is named on its chat calls (gen_ai.response.model / gen_ai.request.model)")
        fix = f"add {model} under pricing.models in the config (0 for a self-hosted model)"
        named = self.overrides.get(model.casefold())
        if named is not None and named[1].provider in (None, provider):
            key, rate = named
            usd = ((usage.input_tokens or 0) * rate.input_per_mtok
                   + (usage.output_tokens or 0) * rate.output_per_mtok) / 1e6
            if usage.input_tokens is None and usage.output_tokens is None and usage.total_tokens:
                return Quote(None, f"{model}: a total without its input/output split cannot be priced")
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
        try:
            price = calc_price(genai_prices.Usage(input_tokens=usage.input_tokens or 0,
                                                  output_tokens=usage.output_tokens or 0),
                               model, provider_id=provider_id, genai_request_timestamp=_when(at_ns))
        except LookupError:
            on = f" from {provider}" if provider else ""
            hint = " (a span that names an Azure OpenAI deployment, not its model)" if provider_id == "azure" else ""
            return Quote(None, f"genai-prices {genai_prices.__version__} does not know model {model!r}{on}{hint}: {fix}")
        return Quote(float(price.total_price), f"{_SOURCE}: {price.provider.id} {price.model.id}")


def _when(at_ns: int | None) -> datetime | None:
    """A call's start as the price date (prices change); None (now) when unknown or not a plausible time."""
    if at_ns is None or not 0 < at_ns < 2**63:
        return None
    return datetime.fromtimestamp(at_ns / 1e9, timezone.utc)
