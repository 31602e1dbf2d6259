# Any release may be instrumented: the instrumentor checks for the hooks it needs (see __init__), not
# a version. The releases the project's tests ran on; outside them it instruments and warns once.
_instruments = ("agent-framework-core",)
TESTED_OLDEST = "1.22.0"
TESTED_NEWEST = "1.26.0"
