"""The client SDK: `Client` and `AsyncClient` for any starjar GenerateService
(a target worker, or the controller's front end).

    from starjar import Client
    with Client("127.0.0.1:50051") as c:
        print(c.generate("Hello", max_tokens=32).text)
        for chunk in c.generate_stream("Tell me a story", temperature=0.7):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from starjar.errors import InvalidArgument, StarjarError
from starjar.service.status import error_field
from starjar.spec.draft_cap import draft_cap_from_mapping
from starjar.spec.sampling import SamplingParams
from starjar.spec.token_ids import WIRE_LIMIT, check_token_ids
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc
from starjar.wire.keys import AUTH_METADATA, refusal_reason
from starjar.wire.request import sampling_to_proto, set_draft_cap


class ClientError(StarjarError):
    """A call failed; `code` is the gRPC status code, `details` the server's message, `reason` the
    machine-readable reason of a refusal (e.g. "queue_full") and `field` the request field at fault, when the
    server gave them."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str | None = None, field: str | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason
        self.field = field


class InvalidRequest(ClientError):
    """The server rejected the request (INVALID_ARGUMENT); details name the field."""


class Unavailable(ClientError):
    """No server answered (UNAVAILABLE)."""


class Timeout(ClientError):
    """The per-call timeout passed (DEADLINE_EXCEEDED)."""


class Unauthenticated(ClientError):
    """The auth token was missing or wrong (UNAUTHENTICATED / PERMISSION_DENIED)."""


class Overloaded(ClientError):
    """The service is full (RESOURCE_EXHAUSTED): retry later. `reason` says what is full."""


_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest, grpc.StatusCode.UNAVAILABLE: Unavailable,
           grpc.StatusCode.DEADLINE_EXCEEDED: Timeout, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
           grpc.StatusCode.PERMISSION_DENIED: Unauthenticated, grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded}


def _error(exc: grpc.RpcError) -> ClientError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return _ERRORS.get(code, ClientError)(code, details or "", refusal_reason(exc), error_field(exc))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int = 0  # draft tokens verified for this request
    accepted_draft_tokens: int = 0  # of which accepted


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens since the previous chunk; the last chunk has finish_reason, usage and timing."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None  # achieved time per output token
    tpot_slo_met: bool | None = None  # None when the request gave no tpot_slo_s


@dataclass
class GenerationResult:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    tpot_slo_met: bool | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        if chunk.finish_reason is not None:
            self.finish_reason, self.usage = chunk.finish_reason, chunk.usage
            self.ttft_s, self.e2e_s = chunk.ttft_s, chunk.e2e_s
            self.tpot_s, self.tpot_slo_met = chunk.tpot_s, chunk.tpot_slo_met


# Sampling arguments that protobuf would take only of these types (its own errors name no field).
_NUMBER_TYPES = {"temperature": (int, float), "top_p": (int, float), "tpot_slo_s": (int, float),
                 "max_tokens": (int,), "top_k": (int,), "seed": (int,)}


def _request(prompt, prompt_token_ids, chat, request_id, model, tpot_slo_s=None, speculation=None,
             **sampling) -> pb.GenerateRequest:
    """The request, checked here first: a bad argument is an InvalidRequest naming it, as the server's would be
    (not a ValueError or TypeError from protobuf, which names nothing)."""
    try:
        _check_arguments(prompt_token_ids, {**sampling, "tpot_slo_s": tpot_slo_s})
        cap = draft_cap_from_mapping(speculation)
        params = SamplingParams(**{k: v for k, v in sampling.items() if v is not None})  # validates locally
        req = pb.GenerateRequest(request_id=request_id or "", prompt=prompt or "",
                                 prompt_token_ids=list(prompt_token_ids or ()), chat=chat, model=model or "",
                                 sampling=sampling_to_proto(params))
        if tpot_slo_s is not None:
            req.tpot_slo_s = float(tpot_slo_s)
        set_draft_cap(req, cap)
    except InvalidArgument as exc:
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, str(exc), field=exc.field) from None
    except (TypeError, ValueError) as exc:  # a value of the wrong type for its field
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {exc}") from None
    return req


def _check_arguments(prompt_token_ids, values: dict) -> None:
    """InvalidArgument for token ids that are not integers on the wire, or a number argument of another type."""
    for name, ids in (("prompt_token_ids", prompt_token_ids), ("stop_token_ids", values.get("stop_token_ids"))):
        if ids and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidArgument(name, "token ids must be integers")
        check_token_ids(name, ids or (), WIRE_LIMIT)
    for name, types in _NUMBER_TYPES.items():
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise InvalidArgument(name, "must be an integer" if types == (int,) else "must be a number", value)


def _chunk(resp: pb.GenerateResponse) -> GenerationChunk:
    if not resp.finish_reason:
        return GenerationChunk(list(resp.token_ids), resp.text)
    return GenerationChunk(list(resp.token_ids), resp.text, resp.finish_reason,
                           Usage(resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.draft_tokens,
                                 resp.usage.accepted_draft_tokens),
                           resp.timing.ttft_s, resp.timing.e2e_s, resp.timing.tpot_s,
                           resp.timing.tpot_slo_met if resp.timing.HasField("tpot_slo_met") else None)


def _credentials(tls, root_certificates, private_key=None, certificate_chain=None):
    """Channel credentials, or None for plaintext. Certificates given without tls turn TLS on: dropping them
    would send the bearer token in clear; with tls=False they are a contradiction, refused."""
    given = any(x is not None for x in (root_certificates, private_key, certificate_chain))
    if tls is False and given:
        raise InvalidArgument("tls", "is False, but certificates were given (pass tls=True, or no certificates)")
    if tls is None and given:
        tls = True
    if tls is None or tls is False:
        return None
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    # A client certificate is shown to servers that ask for one (mutual TLS).
    return grpc.ssl_channel_credentials(root_certificates=root_certificates, private_key=private_key,
                                        certificate_chain=certificate_chain)


class _Base:
    def __init__(self, address: str, *, timeout: float | None = None, auth_token: str | None = None,
                 tls: bool | grpc.ChannelCredentials | None = None, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 model: str | None = None):
        self.address = address
        self.timeout = timeout
        self.model = model
        self._metadata = ((AUTH_METADATA, f"Bearer {auth_token}"),) if auth_token else ()
        self._creds = _credentials(tls, root_certificates, private_key, certificate_chain)

    def _call_args(self, timeout):
        return {"timeout": timeout if timeout is not None else self.timeout, "metadata": self._metadata}


class Client(_Base):
    """Blocking client. Thread-safe: one Client may serve many threads."""

    def __init__(self, address: str, **kw):
        super().__init__(address, **kw)
        self._channel = (grpc.secure_channel(address, self._creds) if self._creds
                         else grpc.insecure_channel(address))
        self._stub = pb_grpc.GenerateServiceStub(self._channel)

    def generate_stream(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                        max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None, seed: int | None = None, stop_token_ids: Sequence[int] = (),
                        ignore_eos: bool = False, chat: bool = False, request_id: str | None = None,
                        model: str | None = None, timeout: float | None = None,
                        tpot_slo_s: float | None = None,
                        speculation: Mapping[str, int] | None = None) -> Iterator[GenerationChunk]:
        """tpot_slo_s: seconds per output token this request needs (AdaServe); the last chunk says whether it
        held (tpot_s, tpot_slo_met). speculation: {"max_draft_tokens": k} caps the draft tokens verified for this
        request per step (0..16; 0: the target alone; absent: the server's choice); the last chunk's usage
        counts the draft tokens verified and accepted."""
        req = _request(prompt, prompt_token_ids, chat, request_id, model or self.model, tpot_slo_s, speculation,
                       max_tokens=max_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)
        call = self._stub.Generate(req, **self._call_args(timeout))
        try:
            for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()  # no-op once finished; frees the server's sequence if the caller stopped early

    def generate(self, prompt: str | None = None, **kw) -> GenerationResult:
        result = GenerationResult(request_id=kw.get("request_id") or "")
        for chunk in self.generate_stream(prompt, **kw):
            result.add(chunk)
        return result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client (grpc.aio). Create it inside the event loop that uses it."""

    def __init__(self, address: str, **kw):
        super().__init__(address, **kw)
        self._channel = (grpc.aio.secure_channel(address, self._creds) if self._creds
                         else grpc.aio.insecure_channel(address))
        self._stub = pb_grpc.GenerateServiceStub(self._channel)

    async def generate_stream(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                              max_tokens: int | None = None, temperature: float | None = None,
                              top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                              stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, chat: bool = False,
                              request_id: str | None = None, model: str | None = None,
                              timeout: float | None = None, tpot_slo_s: float | None = None,
                              speculation: Mapping[str, int] | None = None) -> AsyncIterator[GenerationChunk]:
        req = _request(prompt, prompt_token_ids, chat, request_id, model or self.model, tpot_slo_s, speculation,
                       max_tokens=max_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)
        call = self._stub.Generate(req, **self._call_args(timeout))
        try:
            async for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **kw) -> GenerationResult:
        result = GenerationResult(request_id=kw.get("request_id") or "")
        async for chunk in self.generate_stream(prompt, **kw):
            result.add(chunk)
        return result

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
