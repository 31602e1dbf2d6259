"""Receiver security: TLS / mTLS material and bearer-token checks (never logged)."""

from __future__ import annotations

import hmac
import ssl
from pathlib import Path

import grpc

from collector.config import ConfigError, Tls


class BearerAuth:
    """Check of ``Authorization: Bearer <token>``; ``None`` token means auth is off.

    The scheme is case-insensitive (RFC 7235 §2.1: ``bearer`` and ``BEARER`` too); the token is
    compared in constant time.
    """

    def __init__(self, token: str | None) -> None:
        self._expected = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def allows(self, header: str | None) -> bool:
        if self._expected is None:
            return True
        if header is None:
            return False
        scheme, _, credentials = header.strip().partition(" ")
        # Always compare, so a wrong scheme takes as long as a wrong token.
        matches = hmac.compare_digest(credentials.lstrip(" ").encode("utf-8", "surrogatepass"), self._expected)
        return scheme.lower() == "bearer" and matches


def grpc_authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The call's ``authorization`` metadata value, if any."""
    value = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    return value if isinstance(value, str) else None


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"receivers.tls.{key}: {exc.strerror or exc}") from exc


def _pair(tls: Tls) -> tuple[str, str]:
    """An enabled Tls's certificate and key files (its validator sets both or neither)."""
    if not tls.cert_file or not tls.key_file:
        raise ConfigError("receivers.tls: cert_file and key_file are not set")
    return tls.cert_file, tls.key_file


def grpc_credentials(tls: Tls) -> grpc.ServerCredentials:
    cert_file, key_file = _pair(tls)
    ca = _read(tls.client_ca_file, "client_ca_file") if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(_read(key_file, "key_file"), _read(cert_file, "cert_file"))],
        root_certificates=ca, require_client_auth=ca is not None)


def ssl_context(tls: Tls) -> ssl.SSLContext:
    cert_file, key_file = _pair(tls)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert_file, key_file)
        if tls.client_ca_file:
            ctx.load_verify_locations(tls.client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"receivers.tls: {exc}") from exc
    return ctx
