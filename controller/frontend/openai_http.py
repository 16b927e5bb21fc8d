"""OpenAI-compatible HTTP endpoint: /v1/completions, /v1/chat/completions, /v1/models, /health.

This module is the HTTP half: routes, the relay through the router and
server-sent events; what a request may say and how a response looks is in
controller.frontend.openai_protocol. Each HTTP request becomes GenerateRequests relayed
through the same router as the gRPC front end, so both give the same tokens
and text. Streaming uses server-sent events ending with `data: [DONE]`.
Errors map through the same table as gRPC (starjar.service.status), then to HTTP:
bad input answers 400 with {"error": {"message", "type", "param"}}, never a
traceback; overload answers 429 with Retry-After and the machine-readable
reason in "code" (queue_full: every worker's queue is full; front_end_full);
a request that outlives the request timeout answers 504. A client that
disconnects cancels its generation, streaming or not (the front end's
AppRunner is made with handler_cancellation). A declared body past the limit
answers 413 before any of it is read, one that does not arrive within the body
timeout 408 (frontend_limits.HttpLimits); a large body is parsed and checked
on a thread, so the event loop keeps streaming to everyone else meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc
from aiohttp import web

from controller.frontend.grpc_service import check_bearer, timed_out
from controller.frontend.limits import DEFAULT_HTTP_LIMITS, DEFAULT_REQUEST_TIMEOUT_S, HttpLimits, check_request_timeout
from controller.frontend.openai_protocol import Envelope, HttpError, Parsed, parse_chat, parse_completions, parse_json
from controller.frontend.router import TargetRouter
from controller.frontend.stop_strings import StopStrings
from starjar.service.status import INTERNAL_MESSAGE, log_unexpected, status_of
from starjar.v1 import generate_pb2 as pb

log = logging.getLogger(__name__)

# A body up to this size is parsed on the event loop (well under a millisecond); a larger one on a thread.
PARSE_ON_LOOP_BYTES = 64 << 10
RETRY_AFTER_S = 1  # what a 429 asks the client to wait: queues here drain in about a step per request

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
                grpc.StatusCode.UNAVAILABLE: 503}
_HTTP_KIND = {400: "invalid_request_error", 429: "rate_limit_error"}  # anything else: server_error


def tpot_usage(ends: list[dict]) -> dict:
    """The usage extension from the choices' last messages: the slowest achieved TPOT and whether every
    choice met the request's TPOT SLO (only when it gave one)."""
    timings = [e["timing"] for e in ends if e.get("timing") is not None]
    if not timings:
        return {}
    out = {"tpot_s": max(t.tpot_s for t in timings)}
    if all(t.HasField("tpot_slo_met") for t in timings):
        out["tpot_slo_met"] = all(t.tpot_slo_met for t in timings)
    return out


def _add_usage(tokens: list, end: dict) -> None:
    """Add one choice's (prompt, completion, draft, accepted draft) tokens to the request's; a count one choice
    did not report (None) is not reported for the request."""
    for i, n in enumerate(end.get("usage") or ()):
        tokens[i] = None if n is None or tokens[i] is None else tokens[i] + n


def _response(err: HttpError) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
    resp = web.json_response(err.body(), status=err.status, headers=headers)
    if err.status in (408, 413):  # the rest of the body is not wanted: close once the answer is out
        resp.force_close()
    return resp


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"request body is larger than the limit of {limit} bytes ({limit / (1 << 20):g} MiB)",
                     "body")


class OpenAIServer:
    def __init__(self, router: TargetRouter, model_name: str, tokenizer, auth_token: str | None = None,
                 created: int | None = None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 limits: HttpLimits = DEFAULT_HTTP_LIMITS):
        self.router = router
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.auth_token = auth_token
        self.created = created or int(time.time())
        self.request_timeout_s = check_request_timeout(request_timeout_s)  # each relay, retries included
        self.limits = limits
        # One large body parsed at a time: json.loads holds the GIL for its whole run, so more parsing threads
        # would only take more turns from the event loop, not finish sooner.
        self._parsing = asyncio.Semaphore(1)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    # ---- errors ---------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        if request.path.startswith("/v1/") and not check_bearer(request.headers.get("Authorization"),
                                                                self.auth_token):
            return _response(HttpError(401, "missing or wrong bearer token", None, "authentication_error"))
        if (request.content_length or 0) > self.limits.max_body_bytes:
            return _response(_too_large(self.limits.max_body_bytes))  # refused unread
        try:
            return await handler(request)
        except HttpError as exc:
            return _response(exc)
        except web.HTTPRequestEntityTooLarge:  # a chunked body, which declares no length, past the limit
            return _response(_too_large(self.limits.max_body_bytes))
        except web.HTTPException:
            raise
        except Exception as exc:
            return _response(self._http_error(exc, request.path))

    def _http_error(self, exc: Exception, where: str) -> HttpError:
        """Any error as its HTTP answer: the gRPC status table first (a worker's verdict included), then the
        HTTP status of that code."""
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            exc = timed_out(self.request_timeout_s, self.request_timeout_s)
        status = status_of(exc)
        if status is None:
            log_unexpected(log, exc, where)
            return HttpError(500, INTERNAL_MESSAGE, None, "server_error")
        http = _HTTP_STATUS.get(status.code, 500)
        return HttpError(http, status.message or status.code.name, status.field,
                         _HTTP_KIND.get(http, "server_error"), status.reason)

    # ---- routes ---------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        up = bool(self.router.targets)
        return web.json_response({"status": "ok" if up else "no target worker", "targets": len(self.router.targets)},
                                 status=200 if up else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "starjar"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await self._parse(request, lambda body: parse_completions(body, self.model_name))
        return await self._respond(request, parsed, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        parsed = await self._parse(request, lambda body: parse_chat(body, self.model_name, has_template))
        parsed.add(ids=await asyncio.to_thread(self._apply_template, parsed.messages))
        return await self._respond(request, parsed, chat=True)

    async def _parse(self, request: web.Request, check: Callable[[dict], Parsed]) -> Parsed:
        """The body, read within the body timeout, as JSON and then checked by `check`: a large one on a thread
        (a few megabytes of token ids take a few hundred milliseconds to parse and check)."""
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise HttpError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                            "body") from None
        content_type = request.content_type

        def work() -> Parsed:
            return check(parse_json(raw, content_type))
        if len(raw) <= PARSE_ON_LOOP_BYTES:
            return work()
        async with self._parsing:
            return await asyncio.to_thread(work)

    def _apply_template(self, chat: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    async def _respond(self, request: web.Request, parsed: Parsed, chat: bool) -> web.StreamResponse:
        envelope = Envelope.new(parsed.model, chat)
        if parsed.stream:
            return await self._stream(request, parsed, envelope)
        return await self._whole(parsed, envelope)

    # ---- relaying -------------------------------------------------------------------------------

    async def _pieces(self, req: pb.GenerateRequest, stops: list[str]) -> AsyncIterator[tuple[str, dict | None]]:
        """(text, None) while generating, then ("", {"finish_reason", "usage"}) once."""
        cut = StopStrings(stops)
        generated = 0
        async with aclosing(self.router.generate(req, timeout=self.request_timeout_s)) as upstream:
            async for resp in upstream:
                generated += len(resp.token_ids)
                text = cut.push(resp.text)
                if cut.stopped:
                    # Usage still counts what the worker generated (up to the chunk with the stop string).
                    yield text, {"finish_reason": "stop",
                                 "usage": (await self._prompt_tokens(req), generated, None, None)}
                    return  # leaving the loop cancels the worker's sequence
                if resp.finish_reason:
                    text += cut.flush()
                    yield text, {"finish_reason": resp.finish_reason,
                                 "usage": (resp.usage.prompt_tokens, resp.usage.completion_tokens,
                                           resp.usage.draft_tokens, resp.usage.accepted_draft_tokens),
                                 "timing": resp.timing}
                    return
                if text:
                    yield text, None

    async def _prompt_tokens(self, req: pb.GenerateRequest) -> int:
        if req.prompt_token_ids:
            return len(req.prompt_token_ids)
        ids = await asyncio.to_thread(lambda: self.tokenizer(req.prompt)["input_ids"])
        return len(ids)

    async def _collect(self, req: pb.GenerateRequest, stops: list[str]) -> tuple[str, dict]:
        text, end = "", {}
        async for piece, fin in self._pieces(req, stops):
            text += piece
            if fin:
                end = fin
        return text, end

    async def _whole(self, parsed: Parsed, envelope: Envelope) -> web.Response:
        tasks = [asyncio.create_task(self._collect(r, parsed.stops)) for r in parsed.requests]
        try:  # the first choice to fail fails the request: the others must not generate on for nobody
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        tokens = [0, 0, 0, 0]
        for _, end in results:
            _add_usage(tokens, end)
        return web.json_response(envelope.whole([(text, end.get("finish_reason")) for text, end in results],
                                                tuple(tokens), tpot_usage([end for _, end in results])))

    # ---- server-sent events ---------------------------------------------------------------------

    async def _stream(self, request: web.Request, parsed: Parsed, envelope: Envelope) -> web.StreamResponse:
        """Start every choice and wait for the first piece, so an error before any output is a plain HTTP
        error; then stream each choice's pieces as events as they come."""
        merged: asyncio.Queue = asyncio.Queue()  # (choice, text, finish or None, error or None)
        tasks = [asyncio.create_task(self._pump(i, r, parsed.stops, merged)) for i, r in enumerate(parsed.requests)]
        try:  # whatever ends this (an error, the client leaving), no pump may outlive it
            first = await merged.get()
            if first[3] is not None:
                raise first[3]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                await self._events(resp, parsed, envelope, first, merged)
            except ConnectionResetError:
                log.debug("client left stream %s", envelope.id)
            return resp
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, i: int, req: pb.GenerateRequest, stops: list[str], merged: asyncio.Queue) -> None:
        try:
            async for piece, fin in self._pieces(req, stops):
                await merged.put((i, piece, fin, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # told to the client as an error event (or a plain HTTP error, if first)
            await merged.put((i, "", None, exc))

    async def _events(self, resp: web.StreamResponse, parsed: Parsed, envelope: Envelope, item,
                      merged: asyncio.Queue) -> None:
        async def send(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if envelope.chat:
            for i in range(len(parsed.requests)):
                await send(envelope.role_chunk(i))
        tokens, open_choices, ends = [0, 0, 0, 0], len(parsed.requests), []
        while open_choices:
            i, piece, fin, err = item if item is not None else await merged.get()
            item = None
            if err is not None:
                await send(self._http_error(err, f"stream {envelope.id}").body())
                break
            if piece:
                await send(envelope.chunk(i, piece, None))
            if fin:
                open_choices -= 1
                await send(envelope.chunk(i, None if envelope.chat else "", fin["finish_reason"]))
                _add_usage(tokens, fin)
                ends.append(fin)
        if parsed.include_usage:
            await send(envelope.usage_chunk(tuple(tokens), tpot_usage(ends)))
        await resp.write(b"data: [DONE]\n\n")
