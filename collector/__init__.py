"""agenteval-collector: reconciles agent-framework token/finish accounting against the chat boundary.

The packages follow the pipeline, each importing only those below it (pyproject ``[tool.importlinter]``,
checked by tests/test_layers.py):

- ``ui`` and ``demo``: the ``agenteval`` command line, terminal rendering, ``watch``; the demo workflows.
- ``live``: the running collector: receivers, assembly, crash journal, pipeline, server, logs.
- ``outputs``: what verdicts become: emitted spans, metrics, the gRPC service, the run page, export.
- ``security`` and ``config``: TLS and bearer tokens; the typed configuration every stage reads.
- ``store`` and ``formats``: the run store (SQLite, PostgreSQL); trace files and OTLP decoding.
- ``core``: the model, span classification, reconciliation, profiles, the JSON form: pure logic.

``api`` is the generated gRPC code (``make proto``); ``bridge`` the pre-instrumentation public API.
"""
