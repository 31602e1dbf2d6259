"""The receivers (docs/design.md §3): one module per transport, each a component the server starts
and stops."""
