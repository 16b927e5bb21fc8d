"""The public GenerateService of a cluster: checks each request, then relays it to a target worker.

The request is validated here first (shape, model name, sampling values) so a
bad one never reaches a worker; what needs the tokenizer (the prompt length)
is checked by the worker, whose INVALID_ARGUMENT is passed through unchanged.
When the caller goes away, the relay is cancelled, and the worker frees the
sequence and its draft session.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from contextlib import aclosing

import grpc

from controller.router import NoTargets, TargetRouter
from starjar.errors import InvalidArgument
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc
from starjar.wire import check_request_shape, sampling_from_proto

log = logging.getLogger(__name__)


def check_bearer(header: str | None, token: str | None) -> bool:
    """True when no token is configured, or the header is 'Bearer <token>' (constant-time compare)."""
    if not token:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].encode(), token.encode())


class FrontendGenerateService(pb_grpc.GenerateServiceServicer):
    def __init__(self, router: TargetRouter, model_name: str, auth_token: str | None = None):
        self.router = router
        self.model_name = model_name
        self.auth_token = auth_token

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        metadata = dict(context.invocation_metadata() or ())
        if not check_bearer(metadata.get("authorization"), self.auth_token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            check_request_shape(request, self.model_name)
            sampling_from_proto(request.sampling)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.request_id:
            request.request_id = f"gen-{secrets.token_hex(8)}"
        left = context.time_remaining()
        try:
            # aclosing: a caller who leaves mid-stream cancels the relay now, not when it is collected.
            async with aclosing(self.router.generate(request, timeout=left)) as upstream:
                async for resp in upstream:
                    yield resp
        except NoTargets as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except grpc.aio.AioRpcError as exc:
            # The worker's verdict (INVALID_ARGUMENT for a too-long prompt, ...) reaches the caller as is.
            await context.abort(exc.code(), exc.details() or "")
