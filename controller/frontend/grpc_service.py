"""The public GenerateService of a cluster: checks each request, then relays it to a target worker.

The request is validated here first (shape, model name, sampling values) so a
bad one never reaches a worker; what needs the tokenizer (the prompt length)
is checked by the worker, whose INVALID_ARGUMENT is passed through unchanged.
Errors are raised, never aborted here: the front end's ErrorStatus interceptor
maps them (starjar.service.status), a worker's own verdict included.
When the caller goes away, the relay is cancelled, and the worker frees the
sequence and its draft session. No relay outlives the front end's request
timeout (or the caller's deadline, when sooner), so a worker that never
answers cannot hold a caller forever.
"""

from __future__ import annotations

import logging
import secrets
from contextlib import aclosing

import grpc

from controller.frontend.limits import DEFAULT_REQUEST_TIMEOUT_S, check_request_timeout
from controller.frontend.router import TargetRouter
from starjar.errors import BadCredentials, TimedOut
from starjar.service.security import token_matches
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc
from starjar.wire.keys import AUTH_METADATA, TIMEOUT
from starjar.wire.request import check_request_shape, sampling_from_proto

log = logging.getLogger(__name__)


def relay_timeout(caller_left: float | None, limit: float) -> float:
    """The relay's deadline: the front end's limit, or the caller's own deadline when sooner."""
    return limit if caller_left is None else min(caller_left, limit)


def timed_out(timeout: float, limit: float) -> TimedOut:
    """What a relay that ran past its deadline answers (gRPC DEADLINE_EXCEEDED, HTTP 504, reason timeout)."""
    return TimedOut(f"the request did not finish within {timeout:g} s (the front end's --request-timeout is "
                    f"{limit:g} s)", reason=TIMEOUT)


BAD_TOKEN = "missing or wrong bearer token"


def check_bearer(header: str | None, token: str | None) -> bool:
    """True when no token is configured, or the header is 'Bearer <token>' (constant-time compare)."""
    return token_matches(header, token or None)


class FrontendGenerateService(pb_grpc.GenerateServiceServicer):
    def __init__(self, router: TargetRouter, model_name: str, auth_token: str | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
        self.router = router
        self.model_name = model_name
        self.auth_token = auth_token
        self.request_timeout_s = check_request_timeout(request_timeout_s)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        metadata = dict(context.invocation_metadata() or ())
        if not check_bearer(metadata.get(AUTH_METADATA), self.auth_token):
            raise BadCredentials(BAD_TOKEN)
        check_request_shape(request, self.model_name)
        sampling_from_proto(request.sampling)
        if not request.request_id:
            request.request_id = f"gen-{secrets.token_hex(8)}"
        timeout = relay_timeout(context.time_remaining(), self.request_timeout_s)
        try:
            # aclosing: a caller who leaves mid-stream cancels the relay now, not when it is collected.
            async with aclosing(self.router.generate(request, timeout=timeout)) as upstream:
                async for resp in upstream:
                    yield resp
        except grpc.aio.AioRpcError as exc:
            # Any other verdict of the worker (INVALID_ARGUMENT for a too-long prompt, queue_full, ...) goes on
            # to the caller as it came, its reason and field included; NoTargets and Overloaded are ours.
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise timed_out(timeout, self.request_timeout_s) from None
            raise
