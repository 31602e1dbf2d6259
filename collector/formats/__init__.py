"""What spans and runs arrive as (docs/design.md §2, §3): offline trace files (``loader``, the AgentEval
trace in ``agenteval_trace``, their JSON ``schemas/``) and OTLP protobuf/JSON decoding (``decode``,
with the compiled decoder of native/ when installed).

May import: ``collector.core``.
"""
