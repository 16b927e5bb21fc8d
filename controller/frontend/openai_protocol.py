"""The OpenAI API as plain data: request parsing and validation, and the response envelope.

No HTTP here (routes, relaying and server-sent events are in
controller.frontend.openai_http): a JSON body goes in, GenerateRequests or an error
naming the field come out, and every response object is built by `Envelope`.
Conventions follow OpenAI's API (and vLLM's where OpenAI is silent):
temperature defaults to 1, completions default to 16 tokens; `top_k` and
`ignore_eos` are accepted as extensions, and so are `tpot_slo_s` and
`speculation` ({"max_draft_tokens": k}: at most k draft tokens verified per
step for the request, 0 = none). temperature goes up to 100
(starjar.spec.sampling.MAX_TEMPERATURE; OpenAI's own limit is 2), and every value is
checked as the JSON gave it, before the wire's float32 could round it (a top_p
of 1e-300 is refused as 1e-300, not as 0). A value out of bounds raises
InvalidArgument (400, its field as "param"); what is not JSON, HttpError.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from starjar.errors import InvalidArgument
from starjar.spec.draft_cap import draft_cap_from_mapping
from starjar.spec.sampling import SamplingParams
from starjar.spec.token_ids import WIRE_LIMIT, first_out_of_range
from starjar.v1 import generate_pb2 as pb
from starjar.wire.request import MAX_PROMPT_CHARS, check_request_shape, sampling_to_proto, set_draft_cap

MAX_PROMPTS = 16  # prompts in one /v1/completions request
MAX_MESSAGES = 256
MAX_STOPS, MAX_STOP_CHARS = 16, 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default
CHAT_DEFAULT_MAX_TOKENS = 256
# Where a lone UTF-16 surrogate can come from in a UTF-8 body: a \uD800-\uDFFF escape, or the bytes of one
# (json.loads decodes with surrogatepass). A body with neither needs no second pass to look for one.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class HttpError(Exception):
    """An answer other than 200, as OpenAI shapes it: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- requests -------------------------------------------------------------------------------------

@dataclass
class Parsed:
    """One HTTP request as the relay needs it: a GenerateRequest per choice, and how to answer."""

    sampling: SamplingParams
    model: str
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = field(default_factory=list)
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    messages: list[dict] | None = None  # chat: the conversation, until the tokenizer's template renders it
    tpot_slo_s: float | None = None  # extension field: the TPOT SLO every choice asks for (AdaServe)
    max_draft_tokens: int | None = None  # extension field speculation.max_draft_tokens, for every choice

    def add(self, prompt: str = "", ids: list[int] | None = None) -> None:
        """One more choice, from a text prompt or prompt token ids, checked as the gRPC front end checks it."""
        req = pb.GenerateRequest(request_id=f"http-{secrets.token_hex(8)}", prompt=prompt,
                                 prompt_token_ids=ids or [], sampling=sampling_to_proto(self.sampling))
        if self.tpot_slo_s is not None:
            req.tpot_slo_s = self.tpot_slo_s
        set_draft_cap(req, self.max_draft_tokens)
        check_request_shape(req, self.model)
        self.requests.append(req)


def parse_json(raw: bytes, content_type: str) -> dict:
    # JSON only: a web page may POST text/plain or a form to a local server without a CORS preflight.
    if content_type != "application/json":
        raise HttpError(415, f"Content-Type must be application/json (got {content_type!r})", "Content-Type")
    try:  # ValueError: also an integer past Python's 4300 digits; RecursionError: nesting too deep
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise HttpError(400, f"malformed JSON body: {str(exc)[:200]}", "body") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the JSON body must be an object", "body")
    if json.detect_encoding(raw) == "utf-8" and not _MAYBE_SURROGATE.search(raw):
        return body
    try:  # JSON may escape a lone UTF-16 surrogate ("\ud800"): not text, and no protobuf string takes it
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise HttpError(400, "the JSON body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text",
                        "body") from None
    return body


def parse_completions(body: dict, model_name: str) -> Parsed:
    """/v1/completions: a prompt, a list of prompts, or token ids (one list, or a list of lists)."""
    _check_model(body, model_name)
    sampling = _sampling(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
    _unsupported(body, "echo", (None, False))
    _unsupported(body, "logprobs", (None,))
    _unsupported(body, "suffix", (None,))
    prompts = _prompts(body.get("prompt"))
    parsed = Parsed(sampling, model_name, tpot_slo_s=_tpot_slo(body),
                    max_draft_tokens=draft_cap_from_mapping(body.get("speculation")))
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            parsed.add(prompt=p)
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in p) \
                and first_out_of_range(p, WIRE_LIMIT) is None:
            parsed.add(ids=p)
        else:
            raise InvalidArgument(f"prompt[{i}]", "token ids must be non-negative integers")
    parsed.stream, parsed.include_usage = _stream_flags(body)
    parsed.stops = _stops(body)
    return parsed


def _prompts(prompt: Any) -> list:
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]  # one prompt as token ids
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise InvalidArgument("prompt", "must be a string, a list of strings, or token ids", prompt)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidArgument("prompt", f"at most {MAX_PROMPTS} prompts per request", len(prompts))
    return prompts


def parse_chat(body: dict, model_name: str, has_template: bool) -> Parsed:
    """/v1/chat/completions: `messages` are checked here; the caller renders them with the chat template
    and adds the one request (Parsed.add)."""
    _check_model(body, model_name)
    sampling = _sampling(body, CHAT_DEFAULT_MAX_TOKENS)
    _unsupported(body, "logprobs", (None, False))
    _unsupported(body, "tools", (None, []))
    messages = _messages(body.get("messages"))
    if not has_template:
        raise InvalidArgument("messages", "the model's tokenizer has no chat template; use /v1/completions")
    parsed = Parsed(sampling, model_name, *_stream_flags(body), messages=messages, tpot_slo_s=_tpot_slo(body),
                    max_draft_tokens=draft_cap_from_mapping(body.get("speculation")))
    parsed.stops = _stops(body)
    return parsed


def _messages(messages: Any) -> list[dict]:
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
    return chat


def _check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise InvalidArgument("model", f"unknown model; this server serves {model_name!r}", model)


def _field(body: dict, name: str, types: tuple, default: Any = None, what: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise InvalidArgument(name, f"must be {what or types[0].__name__}", value)
    return value


def _real(body: dict, name: str, default: float) -> float:
    """A number field as a float; an integer too large for one is refused, not an overflow."""
    value = _field(body, name, (int, float), default, "a number")
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgument(name, "must be a finite number", value) from None


def _unsupported(body: dict, name: str, allowed: tuple) -> None:
    if body.get(name) not in allowed:
        raise InvalidArgument(name, f"not supported (only {allowed[-1]!r})", body.get(name))


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
                          temperature=_real(body, "temperature", 1.0), top_p=_real(body, "top_p", 1.0),
                          top_k=_field(body, "top_k", (int,), 0, "an integer"),
                          seed=seed, ignore_eos=_field(body, "ignore_eos", (bool,), False, "a boolean"))


def _tpot_slo(body: dict) -> float | None:
    """The extension field tpot_slo_s: seconds per output token the request needs, in (0, 3600]."""
    slo = _field(body, "tpot_slo_s", (int, float), None, "a number")
    if slo is not None and not 0 < slo <= 3600:
        raise InvalidArgument("tpot_slo_s", "must be in (0, 3600] seconds", slo)
    return None if slo is None else float(slo)


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


# ---- responses ------------------------------------------------------------------------------------

# A request's token counts: prompt, completion, draft tokens verified and accepted (None: not reported).
Counts = tuple[int, int, int | None, int | None]

def usage(prompt_tokens: int, completion_tokens: int, draft_tokens: int | None = None,
          accepted_draft_tokens: int | None = None, timing: dict | None = None) -> dict:
    """OpenAI's usage. Extensions: draft_tokens (draft tokens the target verified for the request) and
    accepted_draft_tokens (of those, the ones it kept), left out when a choice ended at a stop string before
    its worker reported them; timing: the slowest choice's achieved tpot_s and, when the request gave a
    tpot_slo_s, whether every choice met it (tpot_slo_met)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if draft_tokens is not None and accepted_draft_tokens is not None:
        out.update(draft_tokens=draft_tokens, accepted_draft_tokens=accepted_draft_tokens)
    return {**out, **(timing or {})}


@dataclass(frozen=True)
class Envelope:
    """What every response object of one request shares (id, object, created, model), and its choices."""

    id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> Envelope:
        return cls(("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), int(time.time()), model, chat)

    def wrap(self, obj: str, choices: list[dict], tokens: Counts | None = None,
             timing: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if tokens is not None:
            out["usage"] = usage(*tokens, timing)
        return out

    def whole(self, results: list[tuple[str, str | None]], tokens: Counts,
              timing: dict | None = None) -> dict:
        """The non-streaming answer: per choice (text, finish_reason)."""
        choices = []
        for i, (text, finish) in enumerate(results):
            choice: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return self.wrap("chat.completion" if self.chat else "text_completion", choices, tokens, timing)

    def chunk(self, i: int, text: str | None, finish: str | None) -> dict:
        """One streamed event of choice i: new text (None: none, as in a chat's last chunk) or its finish."""
        if self.chat:
            c = {"index": i, "delta": {} if text is None else {"content": text}, "finish_reason": finish,
                 "logprobs": None}
        else:
            c = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
        return self._event([c])

    def role_chunk(self, i: int) -> dict:
        """A chat stream opens each choice with the assistant's role."""
        return self._event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None}])

    def usage_chunk(self, tokens: Counts, timing: dict | None = None) -> dict:
        """The last event when the client asked for stream_options.include_usage."""
        return self.wrap(self._stream_object(), [], tokens, timing)

    def _event(self, choices: list[dict]) -> dict:
        return self.wrap(self._stream_object(), choices)

    def _stream_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"
