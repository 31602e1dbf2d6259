"""Typed configuration with defaults (docs/design.md §6). The models are the single source of defaults;
``config/collector.yaml`` documents every key and a test keeps the two equal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import platformdirs
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from collector.core.model import FINISH_REASON_MAP, Policy, Preset
from collector.core.profiles import Matcher, ProfileConfig, default_profiles
from collector.core.serialize import MAX_ITEMS


class ConfigError(Exception):
    pass


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def split_endpoint(value: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts in brackets) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)


def _check_endpoint(value: str) -> str:
    split_endpoint(value)
    return value


class GrpcReceiver(_Section):
    enabled: bool = True
    endpoint: str = "127.0.0.1:4317"
    max_message_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    handshake_timeout: float = Field(default=10.0, gt=0)
    read_timeout: float = Field(default=10.0, gt=0)

    _endpoint = field_validator("endpoint")(_check_endpoint)


class HttpReceiver(_Section):
    enabled: bool = True
    endpoint: str = "127.0.0.1:4318"
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    read_timeout: float = Field(default=10.0, gt=0)
    run_page: bool = True

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "trace_link" in data:
            raise ValueError("trace_link is now ui.trace_url (the same template, {trace_id} and {span_id})")
        return data

    _endpoint = field_validator("endpoint")(_check_endpoint)


class Tls(_Section):
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> Tls:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("client_ca_file (mTLS) needs cert_file and key_file")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


def _secret(file: str | None, env: str | None, key: str) -> str | None:
    """A secret from a file or an environment variable (``key`` names the config key in errors)."""
    if file:
        try:
            value = Path(file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{key}_file: {exc.strerror or exc}") from exc
    elif env:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ConfigError(f"{key}_env: ${env} is not set")
    else:
        return None
    if not value:
        raise ConfigError(f"{key}: the secret is empty")
    return value


class Auth(_Section):
    bearer_token_file: str | None = None
    bearer_token_env: str | None = None

    @model_validator(mode="after")
    def _one(self) -> Auth:
        if self.bearer_token_file and self.bearer_token_env:
            raise ValueError("set bearer_token_file or bearer_token_env, not both")
        return self

    def token(self) -> str | None:
        """The configured bearer token (read once at start), or None when auth is off."""
        return _secret(self.bearer_token_file, self.bearer_token_env, "receivers.auth.bearer_token")


#: librdkafka properties the kafka receiver sets itself (from its own keys, or because its offset
#: promise depends on them): not accepted in ``receivers.kafka.client``.
KAFKA_OWN_PROPERTIES = frozenset({
    "bootstrap.servers", "group.id", "client.id", "enable.auto.commit", "enable.auto.offset.store",
    "auto.offset.reset", "partition.assignment.strategy", "on_commit", "error_cb", "logger",
    "enable.partition.eof",
})


class KafkaReceiver(_Section):
    """The ``kafka`` receiver (docs/scale-out.md "Kafka, exact"): OTLP protobuf trace requests from a
    topic, consumed as one consumer group; offsets are committed only up to the oldest message of a
    trace not yet stored."""

    enabled: bool = False
    brokers: list[str] = Field(default_factory=lambda: ["127.0.0.1:9092"], min_length=1)
    topic: str = Field(default="otlp_spans", min_length=1)
    group_id: str = Field(default="agenteval", min_length=1)
    client_id: str = Field(default="agenteval", min_length=1)
    initial_offset: Literal["earliest", "latest"] = "earliest"
    max_message_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    commit_interval: float = Field(default=1.0, gt=0)
    max_metadata_bytes: int = Field(default=4096, ge=0)
    client: dict[str, str | int | float | bool] = Field(default_factory=dict)

    _brokers = field_validator("brokers")(lambda value: [_check_endpoint(b) for b in value])

    @field_validator("client")
    @classmethod
    def _not_ours(cls, value: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        if own := sorted(KAFKA_OWN_PROPERTIES.intersection(value)):
            raise ValueError(f"{', '.join(own)}: set by the receiver itself (its own keys: brokers, group_id, "
                             "client_id, initial_offset), not in client")
        return value


class Receivers(_Section):
    grpc: GrpcReceiver = GrpcReceiver()
    http: HttpReceiver = HttpReceiver()
    kafka: KafkaReceiver = KafkaReceiver()
    tls: Tls = Tls()
    auth: Auth = Auth()
    max_inflight_bytes: int = Field(default=256 * 1024 * 1024, gt=0)

    @model_validator(mode="after")
    def _bodies_fit(self) -> Receivers:
        """Every request within the size limits must fit the budget when nothing else is in flight
        (a request is held twice while it is read: an HTTP body compressed and decompressed, or as read
        and joined; a gRPC message in grpc's buffer and as bytes)."""
        need = 2 * max(self.http.max_body_bytes, self.grpc.max_message_bytes)
        if self.max_inflight_bytes < need:
            raise ValueError(f"max_inflight_bytes must be at least {need} (twice http.max_body_bytes and "
                             "grpc.max_message_bytes), or no request of the largest allowed size fits")
        return self

    @model_validator(mode="after")
    def _one_enabled(self) -> Receivers:
        if not (self.grpc.enabled or self.http.enabled or self.kafka.enabled):
            raise ValueError("no receiver is enabled (grpc, http and kafka all have enabled: false): enable at "
                             "least one, or the collector receives no spans")
        return self


class Assembly(_Section):
    quiet_period: float = Field(default=2.0, gt=0)
    max_trace_wait: float = Field(default=30.0, gt=0)
    late_window: float = Field(default=300.0, ge=0)
    max_spans_in_flight: int = Field(default=500_000, gt=0)
    max_traces_in_flight: int = Field(default=20_000, gt=0)
    max_late_traces: int = Field(default=10_000, ge=0)
    max_late_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    sweep_interval: float = Field(default=1.0, gt=0)
    retry_after: float = Field(default=1.0, gt=0)
    handover: bool | None = None
    handover_after: float = Field(default=10.0, gt=0)


class Scoring(_Section):
    tolerance: float = Field(default=0.02, ge=0, lt=1)
    flag_over_reporting: bool = False
    finish_aliases: dict[str, str] = Field(default_factory=lambda: dict(FINISH_REASON_MAP))
    preset: Preset = "standard"

    @field_validator("finish_aliases")
    @classmethod
    def _over_the_shipped_map(cls, aliases: dict[str, str]) -> dict[str, str]:
        """Entries given are added to the shipped map (a vendor's reason maps to itself to drop one):
        a config naming one alias keeps every vendor's. Compared case-insensitively."""
        return FINISH_REASON_MAP | {key.strip().lower(): value.strip().lower() for key, value in aliases.items()}

    def policy(self) -> Policy:
        return Policy(self.tolerance, self.flag_over_reporting, tuple(sorted(self.finish_aliases.items())))


class Retention(_Section):
    max_age: float | None = Field(default=14 * 86400.0, gt=0)
    max_size: int | None = Field(default=None, gt=0)
    sweep_interval: float = Field(default=60.0, gt=0)
    batch: int = Field(default=200, gt=0)


class Store(_Section):
    url: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    pool_size: int = Field(default=4, gt=0)
    max_queued_runs: int = Field(default=10_000, gt=0)
    max_queue_seconds: float = Field(default=2.0, gt=0)
    max_span_ids_per_unit: int = Field(default=MAX_ITEMS, ge=0)
    retention: Retention = Retention()

    @model_validator(mode="after")
    def _one_password(self) -> Store:
        if self.password_env and self.password_file:
            raise ValueError("set password_env or password_file, not both")
        return self

    def password(self) -> str | None:
        """The PostgreSQL password from the configured env var or file (never from the URL in logs)."""
        return _secret(self.password_file, self.password_env, "store.password")


class OtlpExporter(_Section):
    endpoint: str | None = None
    protocol: Literal["grpc", "http/protobuf"] = "grpc"
    insecure: bool = True
    push_metrics: bool = True
    metrics_interval: float = Field(default=10.0, gt=0)
    max_backlog_spans: int = Field(default=100_000, gt=0)
    retry_interval: float = Field(default=2.0, gt=0)
    shutdown_timeout: float = Field(default=2.0, gt=0)


class Prometheus(_Section):
    enabled: bool = True
    endpoint: str = "127.0.0.1:9464"
    require_auth: bool = False

    _endpoint = field_validator("endpoint")(_check_endpoint)


class Exporters(_Section):
    otlp: OtlpExporter = OtlpExporter()
    prometheus: Prometheus = Prometheus()
    metric_subjects: int = Field(default=100, ge=0)


class Stream(_Section):
    max_watchers: int = Field(default=64, gt=0)
    buffer: int = Field(default=1000, gt=0)


class Journal(_Section):
    enabled: bool = True
    path: str | None = None
    segment_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    max_bytes: int = Field(default=1024 * 1024 * 1024, gt=0)

    def directory(self, store_url: str) -> Path:
        """``path``, else beside a SQLite store (``runs.db.journal``), else in the user data dir."""
        from collector.store import default_store_url, is_postgres

        if self.path:
            return Path(self.path)
        url = store_url or default_store_url()
        if is_postgres(url):
            return Path(platformdirs.user_data_dir("agenteval")) / "journal"
        db = Path(url.removeprefix("sqlite:///"))
        return db.with_name(db.name + ".journal")


class ModelRate(_Section):
    """A model's price by hand (docs/outputs.md "Spend"): USD per million tokens."""

    input_per_mtok: float = Field(ge=0)
    output_per_mtok: float = Field(ge=0)
    #: Only calls whose provider (``gen_ai.provider.name`` / ``gen_ai.system``, as sent) is this one; None: any.
    provider: str | None = None


class Pricing(_Section):
    enabled: bool = True
    #: Model name as the chat spans carry it (case-insensitive) -> its rate; wins over genai-prices.
    models: dict[str, ModelRate] = Field(default_factory=dict)


class Ui(_Section):
    #: A link into the user's trace backend for every trace and span id on the run page.
    trace_url: str | None = None

    @field_validator("trace_url")
    @classmethod
    def _link(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if "{trace_id}" not in value:
            raise ValueError("must contain {trace_id}, e.g. http://localhost:16686/trace/{trace_id}")
        try:
            value.format(trace_id="0", span_id="0")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"only {{trace_id}} and {{span_id}} may be in braces; write a literal brace as "
                             f"{{{{ or }}}} ({exc!r})") from None
        return value


class Logging(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


class CollectorConfig(_Section):
    instance: str | None = None
    shutdown_delay: float = Field(default=0.0, ge=0)
    receivers: Receivers = Receivers()
    assembly: Assembly = Assembly()
    scoring: Scoring = Scoring()
    profiles: dict[str, ProfileConfig] = Field(default_factory=default_profiles)
    store: Store = Store()
    journal: Journal = Journal()
    exporters: Exporters = Exporters()
    stream: Stream = Stream()
    logging: Logging = Logging()
    pricing: Pricing = Pricing()
    ui: Ui = Ui()

    @model_validator(mode="after")
    def _one_durable_log(self) -> CollectorConfig:
        if self.receivers.kafka.enabled and self.journal.enabled:
            raise ValueError("receivers.kafka.enabled: set journal.enabled: false too (with the kafka receiver, "
                             "Kafka is the durable log: a message's offset is committed only once its traces "
                             "are stored)")
        if self.receivers.kafka.enabled and self.assembly.handover:
            raise ValueError("assembly.handover: leave it unset (off) with receivers.kafka.enabled: a trace is whole "
                             "on one replica by construction, and a part handed over through the store would be "
                             "published while Kafka's offsets still promise its messages to the partition's next owner")
        return self

    def matcher(self) -> Matcher:
        return Matcher(list(self.profiles.values()))


#: ``${env:NAME}`` or ``${env:NAME:-default}``, as the OpenTelemetry Collector's confmap writes them;
#: ``$$`` is a literal ``$``.
_ENV_REFERENCE = re.compile(r"\$\$|\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: Any, key: str = "", environ: Mapping[str, str] = os.environ) -> Any:
    """Every ``${env:NAME}`` reference in ``value``'s strings resolved, before validation, so every
    section sees plain values; a string that is one reference alone is read as YAML (a port can be
    an integer), as the OpenTelemetry Collector does. An unset variable without a default is an
    error naming the key."""
    if isinstance(value, dict):
        return {k: expand_env(v, f"{key}.{k}" if key else str(k), environ) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, f"{key}[{i}]", environ) for i, v in enumerate(value)]
    if not isinstance(value, str) or "$" not in value:
        return value

    def resolve(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise ConfigError(f"{key}: ${{env:{name}}} is not set (give a default: ${{env:{name}:-value}})")

    expanded = _ENV_REFERENCE.sub(resolve, value)
    whole = _ENV_REFERENCE.fullmatch(value)
    if whole is not None and whole.group(0) != "$$":
        try:
            return yaml.safe_load(expanded) if expanded.strip() else expanded
        except yaml.YAMLError:
            return expanded
    return expanded


def load_config(path: Path | None) -> CollectorConfig:
    """Load and validate a YAML config; ``None`` means the embedded defaults."""
    if path is None:
        return CollectorConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        data = expand_env(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    try:
        return CollectorConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: "
            + ("unknown key" if err["type"] == "extra_forbidden" else err["msg"])
            for err in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from exc
