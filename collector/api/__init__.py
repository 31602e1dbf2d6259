"""Generated gRPC code for our own API (``proto/``); regenerate with ``make proto``."""
