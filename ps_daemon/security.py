"""TLS and bearer tokens, both ends: what the daemon serves with (from [tls] and [auth] in its
config) and what trainers and ps-admin connect with (`ClientSecurity`).

TLS covers the gRPC port and the TCP data plane alike, with the same certificate; with
`tls.client_ca_file` both demand a client certificate from that CA (mutual TLS), so a client
without one, or with one from another CA, fails in the handshake. The token is a shared
secret read from a file (never from a command line, where `ps` would show it), sent as gRPC
metadata `authorization: Bearer <token>` and, on the data plane, in each DataRequest. A
missing token is UNAUTHENTICATED, a wrong one PERMISSION_DENIED; comparisons take constant
time. Health checks never need it (probes and systemd must see the daemon without secrets).
"""

from __future__ import annotations

import hmac
import logging
import ssl
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from ps_daemon.config import AuthConfig, TlsConfig
from ps_daemon.grpc_handlers import rebuild

log = logging.getLogger(__name__)

# The calls that change a daemon's state from the operator's side; under require_token =
# "admin" only these need the token (the data path and the read-only views stay open).
STATE_CHANGING = frozenset({"/ps.v1.Admin/Evict", "/ps.v1.Admin/Load"})
_OPEN = "/grpc.health.v1.Health/"
METADATA_KEY = "authorization"


def read_token(path: str) -> str:
    """The token: the file's first line, stripped. Warns when others may read the file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    token = text.splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise ValueError(f"token file {path} is empty; put the token on its first line")
    if Path(path).stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is readable by other users; chmod 600 it", path)
    return token


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


# --- the daemon's side -------------------------------------------------------------------


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """Credentials for the gRPC port, or None for plaintext."""
    if not tls.cert_file:
        return None
    chain, key = _read(tls.cert_file, "tls.cert_file"), _read(tls.key_file, "tls.key_file")
    client_ca = _read(tls.client_ca_file, "tls.client_ca_file") if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca, require_client_auth=bool(client_ca))


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The same for the data plane's sockets, or None for plaintext."""
    if not tls.cert_file:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.client_ca_file:
            context.load_verify_locations(tls.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, OSError) as exc:
        raise OSError(f"cannot load the TLS certificate {tls.cert_file} / key {tls.key_file}: {exc}") from None
    return context


class TokenCheck:
    """The token rule of [auth]: which methods need it, and whether a presented value is it.
    `reload()` re-reads the token file (SIGHUP)."""

    def __init__(self, auth: AuthConfig) -> None:
        self.token_file = auth.token_file
        self.require = auth.require_token
        self._token = read_token(auth.token_file) if auth.token_file else ""

    @property
    def enabled(self) -> bool:
        return bool(self._token)

    def reload(self) -> None:
        if self.token_file:
            self._token = read_token(self.token_file)

    def needs_token(self, method: str) -> bool:
        if not self._token or method.startswith(_OPEN):
            return False
        return self.require == "all" or method in STATE_CHANGING

    def refusal(self, method: str, presented: str | None) -> tuple[grpc.StatusCode, str] | None:
        """None if the call may go on, else the status and message to refuse it with.
        `presented`: the `authorization` value the client sent (None: nothing)."""
        if not self.needs_token(method):
            return None
        what = method.rsplit("/", 1)[-1]
        if not presented:
            return grpc.StatusCode.UNAUTHENTICATED, (
                f"{what} needs this daemon's bearer token (auth.require_token = {self.require!r}); give the client "
                "the token file (ClientSecurity(token_file=...), ps-admin --token-file or $PS_TOKEN_FILE)"
            )
        scheme, _, token = presented.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token.encode()):
            return grpc.StatusCode.PERMISSION_DENIED, f"{what}: the token presented is not this daemon's"
        return None


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls that need the token and lack it, before the servicer sees them."""

    def __init__(self, check: TokenCheck) -> None:
        self.check = check

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        presented = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY)
        refusal = self.check.refusal(handler_call_details.method, presented)
        return handler if refusal is None else _refusing(handler, *refusal)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that aborts with `code` without reading the request."""

    def abort(_request, context):
        context.abort(code, message)

    return rebuild(handler, lambda _behaviour, _streams: abort)


# --- the client's side -------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSecurity:
    """How a trainer or ps-admin connects to daemons that use TLS or a token."""

    ca_file: str = ""
    """PEM CA bundle that signed the daemons' certificates: connect with TLS. Empty: plaintext."""
    cert_file: str = ""
    """PEM client certificate, for daemons that demand one (mutual TLS); with key_file."""
    key_file: str = ""
    """PEM private key of cert_file."""
    token_file: str = ""
    """File whose first line is the daemons' bearer token; sent with every call."""
    server_name: str = ""
    """Name to check the daemons' certificates against instead of the dialled host (e.g.
    certificates issued for a DNS name while dialling an address)."""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("ClientSecurity: cert_file and key_file go together (mutual TLS), set both or neither")
        if self.cert_file and not self.ca_file:
            raise ValueError("ClientSecurity: a client certificate needs ca_file too (it is sent only over TLS)")

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)

    def token(self) -> str:
        return read_token(self.token_file) if self.token_file else ""

    def channel(self, address: str, options: list[tuple[str, object]]) -> grpc.Channel:
        """A channel to `address`: TLS when ca_file is set, the token on every call when
        token_file is."""
        options = list(options)
        if self.tls:
            cert = _read(self.cert_file, "client certificate") if self.cert_file else None
            key = _read(self.key_file, "client key") if self.key_file else None
            credentials = grpc.ssl_channel_credentials(_read(self.ca_file, "CA file"), key, cert)
            if self.server_name:
                options.append(("grpc.ssl_target_name_override", self.server_name))
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        token = self.token()
        return grpc.intercept_channel(channel, _BearerToken(token)) if token else channel

    def ssl_context(self) -> ssl.SSLContext | None:
        """For the data plane's sockets, or None for plaintext."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel (works on plaintext
    channels too, where call credentials are not allowed)."""

    def __init__(self, token: str) -> None:
        self._entry = (METADATA_KEY, f"Bearer {token}")

    def _with_token(self, continuation: Callable, details: grpc.ClientCallDetails, request):
        return continuation(_CallDetails(details, [*(details.metadata or ()), self._entry]), request)

    intercept_unary_unary = intercept_unary_stream = _with_token
    intercept_stream_unary = intercept_stream_stream = _with_token
