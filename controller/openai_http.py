"""OpenAI-compatible HTTP endpoint: /v1/completions, /v1/chat/completions, /v1/models, /health.

Each HTTP request becomes GenerateRequests relayed through the same router as
the gRPC front end, so both give the same tokens and text. Streaming uses
server-sent events ending with `data: [DONE]`. Conventions follow OpenAI's
API (and vLLM's where OpenAI is silent): temperature defaults to 1, completions
default to 16 tokens; `top_k` and `ignore_eos` are accepted as extensions.
Bad input answers 400 with {"error": {"message", "type", "param"}}, never a traceback.
Overload answers 429 with Retry-After and the machine-readable reason in
"code" (queue_full: every worker's queue is full; front_end_full); a request
that outlives the request timeout answers 504. A client that disconnects
cancels its generation, streaming or not (the front end's AppRunner is made
with handler_cancellation).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
from aiohttp import web

from controller.frontend_grpc import check_bearer, timeout_message
from controller.frontend_limits import DEFAULT_REQUEST_TIMEOUT_S, check_request_timeout
from controller.router import NoTargets, Overloaded, TargetRouter
from controller.stop_strings import StopStrings
from starjar.errors import InvalidArgument
from starjar.sampling import SamplingParams
from starjar.v1 import generate_pb2 as pb
from starjar.wire import MAX_PROMPT_CHARS, check_request_shape, refusal_reason, sampling_to_proto

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
MAX_PROMPTS = 16  # prompts in one /v1/completions request
MAX_MESSAGES = 256
MAX_STOPS, MAX_STOP_CHARS = 16, 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default
CHAT_DEFAULT_MAX_TOKENS = 256
RETRY_AFTER_S = 1  # what a 429 asks the client to wait: queues here drain in about a step per request


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def _overloaded(message: str, reason: str | None) -> HttpError:
    return HttpError(429, message, None, "rate_limit_error", reason)


def _invalid(exc: InvalidArgument) -> HttpError:
    return HttpError(400, str(exc), exc.field)


_GRPC_TO_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
                 grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
                 grpc.StatusCode.UNAVAILABLE: 503}


def _from_grpc(exc: grpc.aio.AioRpcError) -> HttpError:
    if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _overloaded(exc.details() or "overloaded", refusal_reason(exc))
    status = _GRPC_TO_HTTP.get(exc.code(), 500)
    details = exc.details() or exc.code().name
    param = details.split(":", 1)[0].removeprefix("invalid ").strip() if status == 400 else None
    return HttpError(status, details, param, "invalid_request_error" if status == 400 else "server_error")


# ---- request parsing ------------------------------------------------------------------------

def _field(body: dict, name: str, types: tuple, default: Any = None, what: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise InvalidArgument(name, f"must be {what or types[0].__name__}", value)
    if not isinstance(value, types):
        raise InvalidArgument(name, f"must be {what or types[0].__name__}", value)
    return value


def _unsupported(body: dict, name: str, allowed: tuple) -> None:
    if body.get(name) not in allowed:
        raise InvalidArgument(name, f"not supported (only {allowed[-1]!r})", body.get(name))


@dataclass
class Parsed:
    """One HTTP request as the relay needs it."""

    requests: list[pb.GenerateRequest]
    stops: list[str]
    stream: bool
    include_usage: bool
    model: str


def _sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidArgument("max_tokens", "must be an integer", max_tokens)
    seed = _field(body, "seed", (int,), None, "an integer")
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, (int, float), 0, "a number") != 0:
            raise InvalidArgument(name, "not supported (only 0)", body[name])
    _unsupported(body, "n", (None, 1))
    _unsupported(body, "best_of", (None, 1))
    _unsupported(body, "logit_bias", (None, {}))
    return SamplingParams(max_tokens=max_tokens,
                          temperature=float(_field(body, "temperature", (int, float), 1.0, "a number")),
                          top_p=float(_field(body, "top_p", (int, float), 1.0, "a number")),
                          top_k=_field(body, "top_k", (int,), 0, "an integer"),
                          seed=seed, ignore_eos=_field(body, "ignore_eos", (bool,), False, "a boolean"))


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop", "must be a string or a list of strings", stop)
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidArgument("stop", f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
    return stops


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _field(body, "stream", (bool,), False, "a boolean")
    opts = _field(body, "stream_options", (dict,), {}, "an object")
    return stream, bool(opts.get("include_usage", False))


# ---- the server ---------------------------------------------------------------------------------

class OpenAIServer:
    def __init__(self, router: TargetRouter, model_name: str, tokenizer, auth_token: str | None = None,
                 created: int | None = None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
        self.router = router
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.auth_token = auth_token
        self.created = created or int(time.time())
        self.request_timeout_s = check_request_timeout(request_timeout_s)  # each relay, retries included

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        if request.path.startswith("/v1/") and not check_bearer(request.headers.get("Authorization"),
                                                                self.auth_token):
            return HttpError(401, "missing or wrong bearer token", None, "authentication_error").response()
        try:
            return await handler(request)
        except HttpError as exc:
            return exc.response()
        except InvalidArgument as exc:
            return _invalid(exc).response()
        except web.HTTPRequestEntityTooLarge:
            return HttpError(413, f"request body is larger than {MAX_BODY_BYTES} bytes").response()
        except web.HTTPException:
            raise
        except Exception:
            log.exception("unexpected error on %s", request.path)
            return HttpError(500, "internal error", None, "server_error").response()

    async def health(self, request: web.Request) -> web.Response:
        up = bool(self.router.targets)
        return web.json_response({"status": "ok" if up else "no target worker", "targets": len(self.router.targets)},
                                 status=200 if up else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "starjar"}]})

    async def _body(self, request: web.Request) -> dict:
        # JSON only: a web page may POST text/plain or a form to a local server without a CORS preflight.
        if request.content_type != "application/json":
            raise HttpError(415, f"Content-Type must be application/json (got {request.content_type!r})",
                            "Content-Type")
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"malformed JSON body: {exc}", "body") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the JSON body must be an object", "body")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise InvalidArgument("model", f"unknown model; this server serves {self.model_name!r}", model)
        return body

    def _request(self, sampling: SamplingParams, prompt: str = "", ids: list[int] | None = None) -> pb.GenerateRequest:
        req = pb.GenerateRequest(request_id=f"http-{secrets.token_hex(8)}", prompt=prompt,
                                 prompt_token_ids=ids or [], sampling=sampling_to_proto(sampling))
        check_request_shape(req, self.model_name)
        return req

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        sampling = _sampling(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
        _unsupported(body, "echo", (None, False))
        _unsupported(body, "logprobs", (None,))
        _unsupported(body, "suffix", (None,))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompts = [prompt]  # one prompt as token ids
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            prompts = prompt
        else:
            raise InvalidArgument("prompt", "must be a string, a list of strings, or token ids", prompt)
        if len(prompts) > MAX_PROMPTS:
            raise InvalidArgument("prompt", f"at most {MAX_PROMPTS} prompts per request", len(prompts))
        reqs = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                reqs.append(self._request(sampling, prompt=p))
            elif all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in p):
                reqs.append(self._request(sampling, ids=p))
            else:
                raise InvalidArgument(f"prompt[{i}]", "token ids must be non-negative integers")
        stream, include_usage = _stream_flags(body)
        parsed = Parsed(reqs, _stops(body), stream, include_usage, self.model_name)
        return await self._respond(request, parsed, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        sampling = _sampling(body, CHAT_DEFAULT_MAX_TOKENS)
        _unsupported(body, "logprobs", (None, False))
        _unsupported(body, "tools", (None, []))
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("messages", "must be a non-empty list of {role, content} objects")
        if len(messages) > MAX_MESSAGES:
            raise InvalidArgument("messages", f"at most {MAX_MESSAGES} messages", len(messages))
        chat, chars = [], 0
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise InvalidArgument(f"messages[{i}].role", "must be system, user or assistant",
                                      m.get("role") if isinstance(m, dict) else m)
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text is understood
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise InvalidArgument(f"messages[{i}].content", "only text parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")
            chars += len(content)
            chat.append({"role": m["role"], "content": content})
        if chars > MAX_PROMPT_CHARS:
            raise InvalidArgument("messages", f"at most {MAX_PROMPT_CHARS} characters in all", chars)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument("messages", "the model's tokenizer has no chat template; use /v1/completions")
        ids = await asyncio.to_thread(self._apply_template, chat)
        stream, include_usage = _stream_flags(body)
        parsed = Parsed([self._request(sampling, ids=ids)], _stops(body), stream, include_usage, self.model_name)
        return await self._respond(request, parsed, chat=True)

    def _apply_template(self, chat: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

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
                    yield text, {"finish_reason": "stop", "usage": (await self._prompt_tokens(req), generated)}
                    return  # leaving the loop cancels the worker's sequence
                if resp.finish_reason:
                    text += cut.flush()
                    yield text, {"finish_reason": resp.finish_reason,
                                 "usage": (resp.usage.prompt_tokens, resp.usage.completion_tokens)}
                    return
                if text:
                    yield text, None

    async def _prompt_tokens(self, req: pb.GenerateRequest) -> int:
        if req.prompt_token_ids:
            return len(req.prompt_token_ids)
        ids = await asyncio.to_thread(lambda: self.tokenizer(req.prompt)["input_ids"])
        return len(ids)

    async def _respond(self, request: web.Request, parsed: Parsed, chat: bool) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        try:
            if parsed.stream:
                return await self._stream(request, parsed, chat, rid, created)
            return await self._whole(parsed, chat, rid, created)
        except (NoTargets, Overloaded, grpc.aio.AioRpcError) as exc:
            raise self._relay_error(exc) from None

    def _relay_error(self, exc: Exception) -> HttpError:
        if isinstance(exc, Overloaded):
            return _overloaded(str(exc), exc.reason)
        if isinstance(exc, NoTargets):
            return HttpError(503, str(exc), None, "server_error")
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return HttpError(504, timeout_message(self.request_timeout_s, self.request_timeout_s), None,
                             "server_error", "timeout")
        return _from_grpc(exc)

    async def _collect(self, req: pb.GenerateRequest, stops: list[str]) -> tuple[str, dict]:
        text, end = "", {}
        async for piece, fin in self._pieces(req, stops):
            text += piece
            if fin:
                end = fin
        return text, end

    async def _whole(self, parsed: Parsed, chat: bool, rid: str, created: int) -> web.Response:
        kind = "chat.completion" if chat else "text_completion"
        results = await asyncio.gather(*(self._collect(r, parsed.stops) for r in parsed.requests))
        choices, prompt_toks, completion_toks = [], 0, 0
        for i, (text, end) in enumerate(results):
            choice = {"index": i, "finish_reason": end.get("finish_reason"), "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
            if end.get("usage"):
                prompt_toks += end["usage"][0]
                completion_toks += end["usage"][1]
        return web.json_response({"id": rid, "object": kind, "created": created, "model": parsed.model,
                                  "choices": choices, "usage": {"prompt_tokens": prompt_toks,
                                                                "completion_tokens": completion_toks,
                                                                "total_tokens": prompt_toks + completion_toks}})

    async def _stream(self, request: web.Request, parsed: Parsed, chat: bool, rid: str,
                      created: int) -> web.StreamResponse:
        kind = "chat.completion.chunk" if chat else "text_completion"
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: pb.GenerateRequest) -> None:
            try:
                async for piece, fin in self._pieces(req, parsed.stops):
                    await merged.put((i, piece, fin, None))
            except (grpc.aio.AioRpcError, NoTargets, Overloaded) as exc:
                await merged.put((i, "", None, exc))

        first = await self._first(parsed, pump, merged)  # fail with a plain HTTP status if nothing started
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(i: int, text: str | None, finish: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                c = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": kind, "created": created, "model": parsed.model, "choices": [c]}

        tasks, item = first
        usage = [0, 0]
        try:
            if chat:
                for i in range(len(parsed.requests)):
                    await send({"id": rid, "object": kind, "created": created, "model": parsed.model,
                                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None, "logprobs": None}]})
            open_choices = len(parsed.requests)
            while open_choices:
                i, piece, fin, err = item if item is not None else await merged.get()
                item = None
                if err is not None:
                    await send(self._relay_error(err).body())
                    break
                if piece:
                    await send(chunk(i, piece, None))
                if fin:
                    open_choices -= 1
                    await send(chunk(i, None if chat else "", fin["finish_reason"]))
                    if fin.get("usage"):
                        usage[0] += fin["usage"][0]
                        usage[1] += fin["usage"][1]
            if parsed.include_usage:
                await send({"id": rid, "object": kind, "created": created, "model": parsed.model, "choices": [],
                            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                      "total_tokens": usage[0] + usage[1]}})
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            log.debug("client left stream %s", rid)  # the pumps are cancelled below: workers free the sequences
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return resp

    async def _first(self, parsed: Parsed, pump, merged: asyncio.Queue):
        """Start every choice and wait for the first piece, so an error before any output is a plain HTTP error."""
        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(parsed.requests)]
        try:
            item = await merged.get()
            if item[3] is not None:
                raise item[3]
        except BaseException:  # an error, or the client left while we waited: no pump may outlive it
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return tasks, item
