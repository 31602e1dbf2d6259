import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[Status]
    STATUS_PASS: _ClassVar[Status]
    STATUS_WARN: _ClassVar[Status]
    STATUS_FAIL: _ClassVar[Status]
    STATUS_PENDING: _ClassVar[Status]

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    VERDICT_AGREE: _ClassVar[Verdict]
    VERDICT_TOKEN_MISMATCH: _ClassVar[Verdict]
    VERDICT_FINISH_MISMATCH: _ClassVar[Verdict]
    VERDICT_BOTH: _ClassVar[Verdict]
    VERDICT_NO_TRUTH: _ClassVar[Verdict]

class NoTruthReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NO_TRUTH_REASON_UNSPECIFIED: _ClassVar[NoTruthReason]
    NO_TRUTH_REASON_NO_CHAT_TRACE: _ClassVar[NoTruthReason]
    NO_TRUTH_REASON_RESPONSE_MISSING: _ClassVar[NoTruthReason]
    NO_TRUTH_REASON_PARTIAL_RESPONSE: _ClassVar[NoTruthReason]
    NO_TRUTH_REASON_LEDGER_MISSING: _ClassVar[NoTruthReason]
    NO_TRUTH_REASON_LEDGER_DERIVED: _ClassVar[NoTruthReason]
    NO_TRUTH_REASON_USAGE_MISSING: _ClassVar[NoTruthReason]
    NO_TRUTH_REASON_LEDGER_UNJOINED: _ClassVar[NoTruthReason]
STATUS_UNSPECIFIED: Status
STATUS_PASS: Status
STATUS_WARN: Status
STATUS_FAIL: Status
STATUS_PENDING: Status
VERDICT_UNSPECIFIED: Verdict
VERDICT_AGREE: Verdict
VERDICT_TOKEN_MISMATCH: Verdict
VERDICT_FINISH_MISMATCH: Verdict
VERDICT_BOTH: Verdict
VERDICT_NO_TRUTH: Verdict
NO_TRUTH_REASON_UNSPECIFIED: NoTruthReason
NO_TRUTH_REASON_NO_CHAT_TRACE: NoTruthReason
NO_TRUTH_REASON_RESPONSE_MISSING: NoTruthReason
NO_TRUTH_REASON_PARTIAL_RESPONSE: NoTruthReason
NO_TRUTH_REASON_LEDGER_MISSING: NoTruthReason
NO_TRUTH_REASON_LEDGER_DERIVED: NoTruthReason
NO_TRUTH_REASON_USAGE_MISSING: NoTruthReason
NO_TRUTH_REASON_LEDGER_UNJOINED: NoTruthReason

class UnattributedChat(_message.Message):
    __slots__ = ("executor", "calls", "tokens")
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    executor: str
    calls: int
    tokens: int
    def __init__(self, executor: _Optional[str] = ..., calls: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class FinishComparison(_message.Message):
    __slots__ = ("invocation", "framework", "truth", "diverged")
    INVOCATION_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    TRUTH_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_FIELD_NUMBER: _ClassVar[int]
    invocation: str
    framework: str
    truth: str
    diverged: bool
    def __init__(self, invocation: _Optional[str] = ..., framework: _Optional[str] = ..., truth: _Optional[str] = ..., diverged: _Optional[bool] = ...) -> None: ...

class Evidence(_message.Message):
    __slots__ = ("framework_tokens", "truth_tokens", "delta", "direction", "tolerance", "framework_finish", "truth_finish", "finish_comparisons", "aligned", "ledger_source", "ledger_missing", "ledger_entries", "response_turns", "request_turns", "ledger_span_ids", "chat_span_ids", "executor_span_ids", "failed_turns", "finish_comparisons_more", "ledger_span_ids_more", "chat_span_ids_more", "executor_span_ids_more", "chat_calls", "chat_calls_more", "ledger", "ledger_more", "framework_input_tokens", "framework_output_tokens", "truth_input_tokens", "truth_output_tokens", "truth_cache_read_tokens", "truth_cache_write_tokens", "truth_reasoning_tokens", "stacked_chat_spans", "chat_layers_disagree", "cost", "ledger_unjoined", "ledger_duplicates")
    FRAMEWORK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUTH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FINISH_FIELD_NUMBER: _ClassVar[int]
    TRUTH_FINISH_FIELD_NUMBER: _ClassVar[int]
    FINISH_COMPARISONS_FIELD_NUMBER: _ClassVar[int]
    ALIGNED_FIELD_NUMBER: _ClassVar[int]
    LEDGER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    LEDGER_MISSING_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TURNS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TURNS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_SPAN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_SPAN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_SPAN_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_TURNS_FIELD_NUMBER: _ClassVar[int]
    FINISH_COMPARISONS_MORE_FIELD_NUMBER: _ClassVar[int]
    LEDGER_SPAN_IDS_MORE_FIELD_NUMBER: _ClassVar[int]
    CHAT_SPAN_IDS_MORE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_SPAN_IDS_MORE_FIELD_NUMBER: _ClassVar[int]
    CHAT_CALLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_CALLS_MORE_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    LEDGER_MORE_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUTH_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUTH_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUTH_CACHE_READ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUTH_CACHE_WRITE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUTH_REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STACKED_CHAT_SPANS_FIELD_NUMBER: _ClassVar[int]
    CHAT_LAYERS_DISAGREE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    LEDGER_UNJOINED_FIELD_NUMBER: _ClassVar[int]
    LEDGER_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    framework_tokens: int
    truth_tokens: int
    delta: int
    direction: str
    tolerance: float
    framework_finish: str
    truth_finish: str
    finish_comparisons: _containers.RepeatedCompositeFieldContainer[FinishComparison]
    aligned: bool
    ledger_source: str
    ledger_missing: bool
    ledger_entries: int
    response_turns: int
    request_turns: int
    ledger_span_ids: _containers.RepeatedScalarFieldContainer[str]
    chat_span_ids: _containers.RepeatedScalarFieldContainer[str]
    executor_span_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_turns: int
    finish_comparisons_more: int
    ledger_span_ids_more: int
    chat_span_ids_more: int
    executor_span_ids_more: int
    chat_calls: _containers.RepeatedCompositeFieldContainer[ChatCall]
    chat_calls_more: int
    ledger: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    ledger_more: int
    framework_input_tokens: int
    framework_output_tokens: int
    truth_input_tokens: int
    truth_output_tokens: int
    truth_cache_read_tokens: int
    truth_cache_write_tokens: int
    truth_reasoning_tokens: int
    stacked_chat_spans: int
    chat_layers_disagree: _containers.RepeatedCompositeFieldContainer[LayerDisagreement]
    cost: UnitCost
    ledger_unjoined: int
    ledger_duplicates: int
    def __init__(self, framework_tokens: _Optional[int] = ..., truth_tokens: _Optional[int] = ..., delta: _Optional[int] = ..., direction: _Optional[str] = ..., tolerance: _Optional[float] = ..., framework_finish: _Optional[str] = ..., truth_finish: _Optional[str] = ..., finish_comparisons: _Optional[_Iterable[_Union[FinishComparison, _Mapping]]] = ..., aligned: _Optional[bool] = ..., ledger_source: _Optional[str] = ..., ledger_missing: _Optional[bool] = ..., ledger_entries: _Optional[int] = ..., response_turns: _Optional[int] = ..., request_turns: _Optional[int] = ..., ledger_span_ids: _Optional[_Iterable[str]] = ..., chat_span_ids: _Optional[_Iterable[str]] = ..., executor_span_ids: _Optional[_Iterable[str]] = ..., failed_turns: _Optional[int] = ..., finish_comparisons_more: _Optional[int] = ..., ledger_span_ids_more: _Optional[int] = ..., chat_span_ids_more: _Optional[int] = ..., executor_span_ids_more: _Optional[int] = ..., chat_calls: _Optional[_Iterable[_Union[ChatCall, _Mapping]]] = ..., chat_calls_more: _Optional[int] = ..., ledger: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., ledger_more: _Optional[int] = ..., framework_input_tokens: _Optional[int] = ..., framework_output_tokens: _Optional[int] = ..., truth_input_tokens: _Optional[int] = ..., truth_output_tokens: _Optional[int] = ..., truth_cache_read_tokens: _Optional[int] = ..., truth_cache_write_tokens: _Optional[int] = ..., truth_reasoning_tokens: _Optional[int] = ..., stacked_chat_spans: _Optional[int] = ..., chat_layers_disagree: _Optional[_Iterable[_Union[LayerDisagreement, _Mapping]]] = ..., cost: _Optional[_Union[UnitCost, _Mapping]] = ..., ledger_unjoined: _Optional[int] = ..., ledger_duplicates: _Optional[int] = ...) -> None: ...

class LayerDisagreement(_message.Message):
    __slots__ = ("span_id", "tokens", "inner_span_ids", "inner_tokens")
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_SPAN_IDS_FIELD_NUMBER: _ClassVar[int]
    INNER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    span_id: str
    tokens: int
    inner_span_ids: _containers.RepeatedScalarFieldContainer[str]
    inner_tokens: int
    def __init__(self, span_id: _Optional[str] = ..., tokens: _Optional[int] = ..., inner_span_ids: _Optional[_Iterable[str]] = ..., inner_tokens: _Optional[int] = ...) -> None: ...

class UnitCost(_message.Message):
    __slots__ = ("model", "framework_usd", "truth_usd", "unreported_usd", "unreported_tokens", "priced_by", "unknown")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_USD_FIELD_NUMBER: _ClassVar[int]
    TRUTH_USD_FIELD_NUMBER: _ClassVar[int]
    UNREPORTED_USD_FIELD_NUMBER: _ClassVar[int]
    UNREPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRICED_BY_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    model: str
    framework_usd: float
    truth_usd: float
    unreported_usd: float
    unreported_tokens: int
    priced_by: str
    unknown: str
    def __init__(self, model: _Optional[str] = ..., framework_usd: _Optional[float] = ..., truth_usd: _Optional[float] = ..., unreported_usd: _Optional[float] = ..., unreported_tokens: _Optional[int] = ..., priced_by: _Optional[str] = ..., unknown: _Optional[str] = ...) -> None: ...

class RunSpend(_message.Message):
    __slots__ = ("framework_usd", "truth_usd", "unreported_usd", "unreported_tokens", "units_priced", "units_unknown")
    FRAMEWORK_USD_FIELD_NUMBER: _ClassVar[int]
    TRUTH_USD_FIELD_NUMBER: _ClassVar[int]
    UNREPORTED_USD_FIELD_NUMBER: _ClassVar[int]
    UNREPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNITS_PRICED_FIELD_NUMBER: _ClassVar[int]
    UNITS_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    framework_usd: float
    truth_usd: float
    unreported_usd: float
    unreported_tokens: int
    units_priced: int
    units_unknown: int
    def __init__(self, framework_usd: _Optional[float] = ..., truth_usd: _Optional[float] = ..., unreported_usd: _Optional[float] = ..., unreported_tokens: _Optional[int] = ..., units_priced: _Optional[int] = ..., units_unknown: _Optional[int] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("usage", "finish_reason", "seq", "invocation", "span_id")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INVOCATION_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    finish_reason: str
    seq: int
    invocation: str
    span_id: str
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ..., finish_reason: _Optional[str] = ..., seq: _Optional[int] = ..., invocation: _Optional[str] = ..., span_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens", "output_tokens", "total_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_READ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WRITE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    total_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    reasoning_tokens: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cache_read_tokens: _Optional[int] = ..., cache_write_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class ChatCall(_message.Message):
    __slots__ = ("usage", "finish_reason", "seq", "invocation", "span_id", "error", "model", "provider")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INVOCATION_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    finish_reason: str
    seq: int
    invocation: str
    span_id: str
    error: str
    model: str
    provider: str
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ..., finish_reason: _Optional[str] = ..., seq: _Optional[int] = ..., invocation: _Optional[str] = ..., span_id: _Optional[str] = ..., error: _Optional[str] = ..., model: _Optional[str] = ..., provider: _Optional[str] = ...) -> None: ...

class ExecutorVerdict(_message.Message):
    __slots__ = ("executor_id", "verdict", "score", "token_diverged", "finish_diverged", "no_truth_reason", "no_truth_explanation", "evidence", "checked", "no_truth_fix")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIVERGED_FIELD_NUMBER: _ClassVar[int]
    FINISH_DIVERGED_FIELD_NUMBER: _ClassVar[int]
    NO_TRUTH_REASON_FIELD_NUMBER: _ClassVar[int]
    NO_TRUTH_EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    NO_TRUTH_FIX_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    verdict: Verdict
    score: float
    token_diverged: bool
    finish_diverged: bool
    no_truth_reason: NoTruthReason
    no_truth_explanation: str
    evidence: Evidence
    checked: bool
    no_truth_fix: str
    def __init__(self, executor_id: _Optional[str] = ..., verdict: _Optional[_Union[Verdict, str]] = ..., score: _Optional[float] = ..., token_diverged: _Optional[bool] = ..., finish_diverged: _Optional[bool] = ..., no_truth_reason: _Optional[_Union[NoTruthReason, str]] = ..., no_truth_explanation: _Optional[str] = ..., evidence: _Optional[_Union[Evidence, _Mapping]] = ..., checked: _Optional[bool] = ..., no_truth_fix: _Optional[str] = ...) -> None: ...

class RunVerdict(_message.Message):
    __slots__ = ("run_id", "trace_id", "subject", "status", "score", "preset", "source", "revision", "incomplete", "checked", "unchecked", "unattributed_chat_spans", "notes", "exit_code", "root_span_id", "updated_at", "executors", "cost_tier", "created_at", "finalized_by", "non_agent_executors", "workflow_errors", "coverage_note", "replayed", "maf_release", "instrumentation_version", "instrumentation_status", "unattributed_chat", "service_name", "workflow_errors_more", "started_at", "duration_s", "split", "spend", "runtime")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    UNCHECKED_FIELD_NUMBER: _ClassVar[int]
    UNATTRIBUTED_CHAT_SPANS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    COST_TIER_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINALIZED_BY_FIELD_NUMBER: _ClassVar[int]
    NON_AGENT_EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_ERRORS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_NOTE_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    MAF_RELEASE_FIELD_NUMBER: _ClassVar[int]
    INSTRUMENTATION_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTRUMENTATION_STATUS_FIELD_NUMBER: _ClassVar[int]
    UNATTRIBUTED_CHAT_FIELD_NUMBER: _ClassVar[int]
    SERVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_ERRORS_MORE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SPEND_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    trace_id: str
    subject: str
    status: Status
    score: float
    preset: str
    source: str
    revision: int
    incomplete: bool
    checked: int
    unchecked: int
    unattributed_chat_spans: int
    notes: _containers.RepeatedScalarFieldContainer[str]
    exit_code: int
    root_span_id: str
    updated_at: _timestamp_pb2.Timestamp
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorVerdict]
    cost_tier: str
    created_at: _timestamp_pb2.Timestamp
    finalized_by: str
    non_agent_executors: _containers.RepeatedScalarFieldContainer[str]
    workflow_errors: _containers.RepeatedScalarFieldContainer[str]
    coverage_note: str
    replayed: bool
    maf_release: str
    instrumentation_version: str
    instrumentation_status: str
    unattributed_chat: _containers.RepeatedCompositeFieldContainer[UnattributedChat]
    service_name: str
    workflow_errors_more: int
    started_at: str
    duration_s: float
    split: bool
    spend: RunSpend
    runtime: str
    def __init__(self, run_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., subject: _Optional[str] = ..., status: _Optional[_Union[Status, str]] = ..., score: _Optional[float] = ..., preset: _Optional[str] = ..., source: _Optional[str] = ..., revision: _Optional[int] = ..., incomplete: _Optional[bool] = ..., checked: _Optional[int] = ..., unchecked: _Optional[int] = ..., unattributed_chat_spans: _Optional[int] = ..., notes: _Optional[_Iterable[str]] = ..., exit_code: _Optional[int] = ..., root_span_id: _Optional[str] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., executors: _Optional[_Iterable[_Union[ExecutorVerdict, _Mapping]]] = ..., cost_tier: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finalized_by: _Optional[str] = ..., non_agent_executors: _Optional[_Iterable[str]] = ..., workflow_errors: _Optional[_Iterable[str]] = ..., coverage_note: _Optional[str] = ..., replayed: _Optional[bool] = ..., maf_release: _Optional[str] = ..., instrumentation_version: _Optional[str] = ..., instrumentation_status: _Optional[str] = ..., unattributed_chat: _Optional[_Iterable[_Union[UnattributedChat, _Mapping]]] = ..., service_name: _Optional[str] = ..., workflow_errors_more: _Optional[int] = ..., started_at: _Optional[str] = ..., duration_s: _Optional[float] = ..., split: _Optional[bool] = ..., spend: _Optional[_Union[RunSpend, _Mapping]] = ..., runtime: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("subject", "statuses", "replay")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    subject: str
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    replay: int
    def __init__(self, subject: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[Status, str]]] = ..., replay: _Optional[int] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("subject", "statuses", "limit", "include_executors")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    subject: str
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    limit: int
    include_executors: bool
    def __init__(self, subject: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[Status, str]]] = ..., limit: _Optional[int] = ..., include_executors: _Optional[bool] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunVerdict]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunVerdict, _Mapping]]] = ...) -> None: ...
