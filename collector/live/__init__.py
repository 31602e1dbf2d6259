"""The running collector (docs/design.md §3): OTLP receivers, the memory budget, trace assembly, the
crash journal, the pipeline from spans to stored verdicts, health, structured logs, and ``server``,
which wires them to the outputs.

May import: ``collector.outputs``, ``collector.security``, ``collector.config``, ``collector.store``,
``collector.formats``, ``collector.core``.
"""
