"""The pure logic (docs/design.md §1, §3): the model, span classification (span facts, run assembly,
the ledger join, chat-call de-duplication), reconciliation, span-shape profiles and the model's JSON
form.

No I/O and no transport: imports nothing of ours outside ``collector.core``, and never protobuf, gRPC,
SQLite, psycopg or structlog (pyproject ``[tool.importlinter]``). Everything else may import it.
"""
