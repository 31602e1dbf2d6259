"""What verdicts become (docs/design.md §3, §4): emitted verdict spans and their retrying export,
Prometheus metrics, the verdict stream and its gRPC service (``wire`` converts runs to messages),
and the HTML run page (``templates/``).

May import: ``collector.security``, ``collector.config``, ``collector.store``, ``collector.formats``,
``collector.core`` and the generated ``collector.api``.
"""
