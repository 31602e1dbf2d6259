"""What pricing adds to reconciling a run: ``reconcile`` of the same runs without a pricer (the
baseline) and with the collector's (``collector.outputs.pricing.Pricing``), side by side, alternating.

    .venv/bin/python bench/pricing.py --runs 2000 --units 3 --calls 3
"""

from __future__ import annotations

import argparse
import time

from collector.config import CollectorConfig
from collector.core.model import ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage
from collector.core.reconcile import reconcile
from collector.outputs.pricing import Pricing

#: Models the workload's chat calls name: two hosted ones genai-prices prices, one it does not.
MODELS = (("gpt-4o-mini", "openai"), ("claude-3-5-sonnet-latest", "anthropic"), ("acme-llm-7", "openai"))


def runs(count: int, units: int, calls: int) -> list[RunInput]:
    start = 1_790_000_000 * 10**9
    out = []
    for r in range(count):
        records = []
        for u in range(units):
            model, provider = MODELS[(r + u) % len(MODELS)]
            turns = tuple(ChatTurn(Usage(1_000 + c, 200 + c), "stop", start + r * 10**6 + c, model=model,
                                   provider=provider) for c in range(calls))
            records.append(ExecutorRecord(f"agent-{u}", (LedgerEntry(Usage(1_000, 200), "stop"),), turns,
                                          "AgentResponseEvent"))
        out.append(RunInput(tuple(records), trace_id=f"{r:032x}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--units", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    workload = runs(args.runs, args.units, args.calls)
    pricer = Pricing(CollectorConfig().pricing)
    reconcile(workload[0], pricer=pricer)  # the rates of each price, calculated once
    best = {"baseline": float("inf"), "priced": float("inf")}
    for _ in range(args.rounds):
        for name, with_pricer in (("baseline", None), ("priced", pricer)):
            began = time.perf_counter()
            for run in workload:
                reconcile(run, pricer=with_pricer)
            best[name] = min(best[name], time.perf_counter() - began)
    per_run = {name: seconds / args.runs * 1e6 for name, seconds in best.items()}
    print(f"{args.runs} runs x {args.units} units x {args.calls} chat calls, best of {args.rounds} rounds")
    for name, micros in per_run.items():
        print(f"  {name:8s} {micros:8.1f} µs per run")
    print(f"  priced / baseline: {per_run['priced'] / per_run['baseline']:.2f}x")


if __name__ == "__main__":
    main()
