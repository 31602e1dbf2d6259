# The compiled module's interface (src/lib.rs, src/decoder.rs, src/facts.rs), for type checkers:
# pyproject.toml's [tool.pyright] reads it from here; maturin ships it in the wheel.
from collections.abc import Callable, Sequence
from typing import Any

def count_spans(payload: bytes) -> int | None: ...
def schema() -> list[tuple[str, list[tuple[int, str]]]]: ...
def py_strip(text: str) -> str: ...

class Decoder:
    def __init__(
        self,
        record: Callable[..., Any],
        *,
        keys: Sequence[Sequence[str]],
        run_names: Sequence[str],
        executor_prefixes: Sequence[str],
        agent_prefixes: Sequence[str],
        chat_prefixes: Sequence[str],
        chat_names: Sequence[str],
        chat_operations: Sequence[str],
        ledger_source: str,
        kinds: tuple[int, int, int, int],
        finish_reason: Callable[..., Any],
        hosts_agent: Callable[[object], bool],
        max_tokens: int,
        own_scope: str,
        service_name: str,
        sdk_language: str,
        max_chars: int,
        max_language_chars: int,
        max_error_chars: int,
        max_value_depth: int,
        status_error: int,
    ) -> None: ...
    def decode(
        self, payload: bytes
    ) -> tuple[list[Any], list[tuple[str, bytes, bytes, bytes]], int, bytes | None] | None:
        """``(spans, rejected, own, line)``, or None to leave the payload to protobuf."""
