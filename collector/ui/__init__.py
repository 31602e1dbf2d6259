"""What a person runs and reads (docs/design.md §6): the ``agenteval`` command line (``cli``), terminal
rendering of runs (``render``) and the live ``watch`` view.

May import every layer below it, and ``collector.demo`` (``agenteval demo``), which uses ``watch`` in
turn.
"""
