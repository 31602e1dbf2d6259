# The versions whose agent run path this instrumentation hooks (see __init__).
_instruments = ("agent-framework-core >= 1.23, < 1.24",)
