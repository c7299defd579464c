"""TLS and bearer tokens, both ends: what the daemon serves with (from [tls] and [auth] in its
config). What trainers and ps-admin connect with is ps_offload.proto.security.ClientSecurity.

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

import grpc

from ps_offload.daemon.config import AuthConfig, TlsConfig
from ps_offload.daemon.rpc.handlers import rebuild
from ps_offload.daemon.rpc.status import RateLimitedLog
from ps_offload.daemon.store.pull_wait import client_address
from ps_offload.proto.channel import method_path
from ps_offload.proto.security import METADATA_KEY, read_file, read_token

log = logging.getLogger(__name__)

# The calls that change a daemon's state from the operator's side; under require_token =
# "admin" only these need the token (the data path and the read-only views stay open).
STATE_CHANGING = frozenset(
    method_path("Admin", name) for name in ("Evict", "Load", "DropModel", "CreateSnapshot", "DeleteSnapshot")
)
_OPEN = "/grpc.health.v1.Health/"


# --- the daemon's side -------------------------------------------------------------------


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """Credentials for the gRPC port, or None for plaintext."""
    if not tls.cert_file:
        return None
    chain, key = read_file(tls.cert_file, "tls.cert_file"), read_file(tls.key_file, "tls.key_file")
    client_ca = read_file(tls.client_ca_file, "tls.client_ca_file") if tls.client_ca_file else None
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
        return handler if refusal is None else _refusing(handler, handler_call_details.method, *refusal)


# A refused token is worth a WARNING (who is knocking?), at most one per 10 s per method and code.
_refused = RateLimitedLog(level=logging.WARNING)


def _refusing(
    handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape that aborts with `code` without reading the request; the
    refusal is logged with the caller's address."""

    def abort(_request, context):
        _refused.info(method.rsplit("/", 1)[-1], code.name, f"from {client_address(context.peer())}: {message}")
        context.abort(code, message)

    return rebuild(handler, lambda _behaviour, _streams: abort)
