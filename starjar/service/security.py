"""Who may talk to a starjar server: one bearer token per cluster, and TLS or mutual TLS on every port.

Every RPC of every server (draft server, target workers, front end) must carry
`authorization: Bearer <token>` when a token is set; the check is constant-time
and only health checks and reflection stay open (load balancers and Ray probe
them). TLS encrypts the wire and, with a client CA, makes every caller show a
certificate that CA signed (mutual TLS). The token travels in call metadata,
so a token without TLS is readable on the network: use both across hosts.

A draft session is bound to the caller that attached it (`caller_identity`):
its certificate's subject under mutual TLS, and its host address always, so a
leaked tag is of no use to anyone else.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from starjar.errors import InvalidArgument, StarjarError
from starjar.service.drain import same_kind_handler
from starjar.wire.keys import AUTH_METADATA

TOKEN_ENV = "STARJAR_AUTH_TOKEN"
# Methods anyone may call: health checks and reflection carry nothing of a session's.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MIN_TOKEN_CHARS = 16


def read_token(token_file: str | None = None) -> str | None:
    """The cluster token: from a file (first line), else $STARJAR_AUTH_TOKEN, else None (no auth)."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise InvalidArgument("--auth-token-file", f"must be a readable file ({exc.strerror})",
                                  token_file) from None
        field = "--auth-token-file"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        field = TOKEN_ENV
    if token and len(token) < MIN_TOKEN_CHARS:
        raise InvalidArgument(field, f"a token must have at least {MIN_TOKEN_CHARS} characters", f"{len(token)}")
    return token or None


def token_matches(header: str | None, token: str | None) -> bool:
    """True when no token is configured, or the header is 'Bearer <token>' (constant-time compare)."""
    if token is None:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    # surrogatepass: an HTTP server hands a header's non-UTF-8 bytes over as lone surrogates (aiohttp's
    # surrogateescape), which plain encode() refuses; encoded alike on both sides, equal bytes mean equal text.
    return hmac.compare_digest(header[len("Bearer "):].encode("utf-8", "surrogatepass"),
                               token.encode("utf-8", "surrogatepass"))


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(flag, f"must be a readable PEM file ({exc.strerror})", path) from None


@dataclass(frozen=True)
class Security:
    """One process's settings. Servers: tls_cert + tls_key turn TLS on; tls_client_ca adds mutual TLS.
    Clients: tls_ca (the CA that signed the servers) turns TLS on; tls_cert + tls_key are the client's own
    certificate, shown when a server asks for one; server_name overrides the name checked in the server's
    certificate (tests, or addresses by IP)."""
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("--tls-cert/--tls-key", "must be given together", None)
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("--tls-client-ca", "needs --tls-cert and --tls-key (mutual TLS is TLS first)",
                                  None)

    # ---- servers --------------------------------------------------------------------------

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenCheck(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on address; a port in use (or an address not this host's) is a StarjarError naming it."""
        try:
            if not self.tls_cert:
                return server.add_insecure_port(address)
            creds = grpc.ssl_server_credentials(
                [(_read(self.tls_key, "--tls-key"), _read(self.tls_cert, "--tls-cert"))],
                root_certificates=_read(self.tls_client_ca, "--tls-client-ca"),
                require_client_auth=bool(self.tls_client_ca))
            return server.add_secure_port(address, creds)
        except RuntimeError as exc:  # grpc's "Failed to bind to address"
            raise StarjarError(f"cannot listen on {address}: the port is in use or the address is not this "
                               f"host's ({exc})") from None

    # ---- clients --------------------------------------------------------------------------

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_METADATA, f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca, "--tls-ca"),
                                            private_key=_read(self.tls_key, "--tls-key"),
                                            certificate_chain=_read(self.tls_cert, "--tls-cert"))

    def channel(self, address: str, options: list | None = None, aio: bool = False):
        options = list(options or [])
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        creds = self.channel_credentials()
        mod = grpc.aio if aio else grpc
        if creds is None:
            return mod.insecure_channel(address, options=options)
        return mod.secure_channel(address, creds, options=options)


CLUSTER_TOKEN_REQUIRED = "authorization: a 'Bearer <cluster token>' header is required"


class TokenCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every RPC without the bearer token (health and reflection excepted). Put it first:
    the interceptors after it (the request's parsing included, see starjar.service.status) then see only callers
    that showed the token."""

    def __init__(self, token: str, message: str = CLUSTER_TOKEN_REQUIRED):
        self._token = token
        self._message = message

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        header = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA)
        if token_matches(header, self._token):
            return handler
        message = self._message

        async def unauthenticated(request, context) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        return same_kind_handler(handler, unauthenticated)


def caller_identity(context) -> str:
    """Who is calling: the client certificate's subject under mutual TLS, and the peer's host."""
    auth = context.auth_context() or {}
    subject = b",".join(auth.get("x509_subject", ()) or auth.get("x509_common_name", ())).decode(errors="replace")
    peer = context.peer() or ""
    host = peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer  # without the port
    return f"{subject}@{host}"
