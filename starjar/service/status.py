"""Errors to gRPC status codes: one table, applied to every servicer by one interceptor.

A servicer raises; it never calls context.abort. `ErrorStatus` turns what a
servicer of ours raised into the call's status:
- a StarjarError: the code from STATUS_CODES, its message as the details, its
  reason and field as trailing metadata (starjar-reason, starjar-field);
- a failed upstream call (grpc.aio.AioRpcError: the front end relaying a
  worker's verdict): passed on as it came, reason and field included;
- anything else: INTERNAL "internal error", after logging the exception's type
  and traceback but never its message (it could quote a prompt). The client
  never sees a traceback, and the front end's router never retries it.
A request whose bytes are not the method's protobuf is INVALID_ARGUMENT too:
grpc would answer UNKNOWN with the DecodeError's text. It is parsed into an
`Undecodable` instead and refused here, after the interceptors before this
one (the token check) have run, so an unauthenticated caller learns nothing.
The OpenAI endpoint reads the same table (`status_of`) before choosing its
HTTP status, so both front doors answer an error alike.
"""

from __future__ import annotations

import inspect
import logging
import traceback
from dataclasses import dataclass

import grpc

from starjar.errors import (
    BadCredentials,
    FailedPrecondition,
    InternalFailure,
    InvalidArgument,
    NotFound,
    NotServing,
    ServerBusy,
    StarjarError,
    TimedOut,
)
from starjar.service.drain import handler_behavior, same_kind_handler
from starjar.wire.keys import FIELD_METADATA, REASON_METADATA, refusal_reason

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error"
OUR_METHODS = "/starjar."  # every service of ours (health and reflection are grpc's own)

# Most specific first does not matter: a class is looked up along its MRO.
STATUS_CODES: dict[type[StarjarError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ServerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotServing: grpc.StatusCode.UNAVAILABLE,
    BadCredentials: grpc.StatusCode.UNAUTHENTICATED,
    TimedOut: grpc.StatusCode.DEADLINE_EXCEEDED,
    InternalFailure: grpc.StatusCode.INTERNAL,
}


@dataclass(frozen=True)
class Status:
    """What a caller is told about a failed call."""

    code: grpc.StatusCode
    message: str
    reason: str | None = None
    field: str | None = None

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        pairs = ((REASON_METADATA, self.reason), (FIELD_METADATA, self.field))
        return tuple((k, v) for k, v in pairs if v)


def status_of(exc: BaseException) -> Status | None:
    """The status an error maps to; None for an unexpected one (answered INTERNAL after logging)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return Status(exc.code(), exc.details() or "", refusal_reason(exc), error_field(exc))
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return Status(code, str(exc), exc.reason, exc.field)
    return None


def error_field(exc) -> str | None:
    """The starjar-field a server put in a failed call's trailing metadata, if any."""
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return dict(metadata or ()).get(FIELD_METADATA)


def log_unexpected(logger: logging.Logger, exc: BaseException, where: str) -> None:
    """Log an unexpected exception by type and traceback only: its message could quote a prompt."""
    frames = "".join(traceback.format_tb(exc.__traceback__))
    logger.error("unexpected %s in %s\n%s", type(exc).__name__, where, frames.rstrip())


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """End the call with the status `exc` maps to (always raises grpc's AbortError)."""
    status = status_of(exc)
    if status is None:
        log_unexpected(log, exc, method)
        status = Status(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    await context.abort(status.code, status.message, trailing_metadata=status.trailing_metadata())


class ErrorStatus(grpc.aio.ServerInterceptor):
    """Give it to grpc.aio.server(), after any token check; it wraps every async method of our services."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(OUR_METHODS):
            return handler
        behavior = handler_behavior(handler)
        streaming = handler.request_streaming
        deserializer = tolerant_deserializer(handler.request_deserializer)
        if inspect.isasyncgenfunction(behavior):
            return same_kind_handler(handler, _mapped_stream(behavior, method, streaming), deserializer)
        if inspect.iscoroutinefunction(behavior):
            return same_kind_handler(handler, _mapped_unary(behavior, method, streaming), deserializer)
        return handler  # a synchronous servicer: none of ours


class Undecodable:
    """A request whose bytes did not parse as its method's message, in the message's place."""

    __slots__ = ("message_name",)

    def __init__(self, message_name: str):
        self.message_name = message_name

    def error(self) -> InvalidArgument:
        return InvalidArgument("request", f"the bytes received are not a valid {self.message_name} (corrupt or "
                               "truncated protobuf)")


def tolerant_deserializer(deserializer):
    """`deserializer` (a message class's FromString), answering an Undecodable where it would raise."""
    if deserializer is None:
        return None
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", "request message")

    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except Exception:  # DecodeError, whatever the bytes: they are the caller's, not a fault of ours
            return Undecodable(name)
    return deserialize


async def _checked(requests, context, method: str):
    """A streaming call's requests, ending the call with INVALID_ARGUMENT at the first that did not parse.
    Aborting (not raising) sends the status at once, whatever the servicer does with the error after."""
    async for request in requests:
        if isinstance(request, Undecodable):
            await abort_with(context, request.error(), method)
        yield request


def _mapped_stream(behavior, method: str, request_streaming: bool):
    async def mapped_stream(request, context):
        try:
            if request_streaming:
                request = _checked(request, context, method)
            elif isinstance(request, Undecodable):
                raise request.error()
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc, method)
    return mapped_stream


def _mapped_unary(behavior, method: str, request_streaming: bool):
    async def mapped_unary(request, context):
        try:
            if request_streaming:
                request = _checked(request, context, method)
            elif isinstance(request, Undecodable):
                raise request.error()
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc, method)
    return mapped_unary
