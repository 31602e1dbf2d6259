"""``agenteval demo``: canned Microsoft Agent Framework workflows (``maf_fakes``) run through the
bridge against a collector, their verdicts watched as they arrive (``demo``).

May import: ``collector.ui`` (``watch``), the layers below it, ``collector.bridge``, ``collector.api``.
"""
