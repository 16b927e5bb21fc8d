"""GenerateService on a target worker: a worker can be used on its own.

A request is admitted into a bounded queue first (refused RESOURCE_EXHAUSTED
when it is full), then tokenized on a worker thread, so a 1 MB prompt never
holds up the event loop that streams every other request's tokens. Errors
are raised as starjar.errors types; the server's ErrorStatus interceptor maps
them to status codes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import aclosing

import grpc

from starjar.errors import InternalFailure, InvalidArgument, NotServing, ServerBusy
from starjar.model.text import encode_prompt
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc
from starjar.wire.request import check_request_shape, draft_cap_from_proto, sampling_from_proto
from target_worker.admission import QUEUE_FULL, AdmissionQueue
from target_worker.detok import IncrementalDetokenizer
from target_worker.engine import StepOutput
from target_worker.runner import ENGINE_STOPPED, EngineRunner
from target_worker.tree_score import MAX_TPOT_SLO_S, tpot_timing

log = logging.getLogger(__name__)
_ids = itertools.count(1)


class GenerateService(pb_grpc.GenerateServiceServicer):
    def __init__(self, runner: EngineRunner, model_name: str, admission: AdmissionQueue | None = None):
        self.runner = runner
        self.engine = runner.engine
        self.model_name = model_name
        self.tokenizer = runner.engine.model.tokenizer
        self.admission = admission or AdmissionQueue(self.engine.config.max_batch_size)

    def _prepare(self, request: pb.GenerateRequest):
        """The one check of a request entering this worker: its prompt as ids, its sampling values and its cap
        on draft tokens per step (speculation.max_draft_tokens; None: the policy's choice)."""
        check_request_shape(request, self.model_name)
        params = sampling_from_proto(request.sampling)
        if request.prompt:
            ids = encode_prompt(self.tokenizer, request.prompt, request.chat)
        else:
            ids = list(request.prompt_token_ids)
        ids = self.engine.check(ids, params)
        if request.HasField("tpot_slo_s") and not 0 < request.tpot_slo_s <= MAX_TPOT_SLO_S:
            raise InvalidArgument("tpot_slo_s", f"must be in (0, {MAX_TPOT_SLO_S:g}] seconds", request.tpot_slo_s)
        return ids, params, draft_cap_from_proto(request)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.runner.dead.is_set():  # not started: the front end retries it on another worker
            raise NotServing(ENGINE_STOPPED)
        if not self.admission.try_enter():
            raise ServerBusy(self.admission.refusal(), reason=QUEUE_FULL)
        try:
            async with aclosing(self._generate(request, context)) as responses:  # closed now, not when collected
                async for resp in responses:
                    yield resp
        finally:
            self.admission.leave()

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.perf_counter()
        ids, params, cap = await asyncio.to_thread(self._prepare, request)  # InvalidArgument names the field
        rid = request.request_id or f"gen-{next(_ids)}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        slo = request.tpot_slo_s if request.HasField("tpot_slo_s") else None
        req = self.runner.submit(ids, params, rid, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out),
                                 slo, cap)
        detok = IncrementalDetokenizer(self.tokenizer)
        log.debug("request %s: %d prompt tokens", rid, len(ids))  # never the prompt text
        try:
            while True:
                out = await outputs.get()
                if out.error == ENGINE_STOPPED:  # never ran here: the front end may retry it on another worker
                    raise NotServing(out.error)
                if out.error is not None:
                    raise InternalFailure(out.error)
                final = out.finished
                resp = pb.GenerateResponse(request_id=rid, token_ids=out.new_token_ids,
                                           text=detok.push(out.new_token_ids, final))
                if final:
                    r = out.request
                    resp.finish_reason = r.finish_reason or ""
                    resp.usage.prompt_tokens = len(r.prompt_ids)
                    resp.usage.completion_tokens = len(r.output_ids)
                    resp.usage.draft_tokens = r.drafted_tokens
                    resp.usage.accepted_draft_tokens = r.accepted_tokens
                    resp.timing.ttft_s = (r.first_token_s or arrival) - arrival
                    resp.timing.e2e_s = (r.finish_s or time.perf_counter()) - arrival
                    tpot_timing(resp.timing, r)
                yield resp
                if final:
                    return
        finally:
            if not req.finished:
                self.runner.cancel(req)  # the client went away: free the sequence and its draft session
