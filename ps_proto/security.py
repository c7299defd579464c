"""What a trainer or ps-admin needs to connect to daemons that use TLS or a bearer token
(`ClientSecurity`), and the token file format both ends read. The daemon's side of the same
settings is ps_offload.daemon.rpc.server_security.

The token is a shared secret read from a file (never from a command line, where `ps` would
show it), sent as gRPC metadata `authorization: Bearer <token>` and, on the data plane, in
each DataRequest.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

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


def read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


# --- the client's side -------------------------------------------------------------------

ENVIRONMENT = {"ca_file": "PS_TLS_CA_FILE", "cert_file": "PS_TLS_CERT_FILE", "key_file": "PS_TLS_KEY_FILE",
               "token_file": "PS_TOKEN_FILE", "server_name": "PS_TLS_SERVER_NAME"}  # fmt: skip
"""ClientSecurity's fields, and the environment variables that set them for trainers and
ps-admin (whose --ca-file, --cert-file, ... options default to them)."""


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

    @classmethod
    def from_environment(cls) -> ClientSecurity:
        """The settings ps-admin reads too: $PS_TLS_CA_FILE, $PS_TLS_CERT_FILE,
        $PS_TLS_KEY_FILE, $PS_TOKEN_FILE and $PS_TLS_SERVER_NAME (unset: plaintext, no
        token), so that one environment serves a job's trainers and its operator alike."""
        return cls(**{name: os.environ.get(variable, "") for name, variable in ENVIRONMENT.items()})

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """ps-admin's --ca-file, --cert-file, --key-file, --token-file and --server-name for a
        training script, each defaulting to its environment variable (`from_arguments`)."""
        group = parser.add_argument_group("daemons with TLS or a token (as ps-admin; else the environment)")
        for name, variable in ENVIRONMENT.items():
            group.add_argument(
                "--" + name.replace("_", "-"),
                dest=f"security_{name}",
                default=os.environ.get(variable, ""),
                metavar="NAME" if name == "server_name" else "PATH",
                help=f"(default: ${variable})",
            )

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> ClientSecurity:
        """The settings `add_arguments`' flags hold."""
        return cls(**{name: getattr(args, f"security_{name}") for name in ENVIRONMENT})

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
            cert = read_file(self.cert_file, "client certificate") if self.cert_file else None
            key = read_file(self.key_file, "client key") if self.key_file else None
            credentials = grpc.ssl_channel_credentials(read_file(self.ca_file, "CA file"), key, cert)
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
