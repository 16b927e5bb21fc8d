"""Protobuf <-> domain conversions shared by every server and the SDK."""

from __future__ import annotations

from starjar.errors import InvalidArgument
from starjar.spec.draft_cap import check_max_draft_tokens
from starjar.spec.sampling import SamplingParams
from starjar.v1 import generate_pb2 as gen_pb

MAX_REQUEST_ID = 128
MAX_PROMPT_CHARS = 1 << 20


def sampling_from_proto(p: gen_pb.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; every value is validated."""
    kw = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if p.HasField(name):
            kw[name] = getattr(p, name)
    if "temperature" in kw:
        kw["temperature"] = float(kw["temperature"])
    return SamplingParams(**kw, stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos)


def sampling_to_proto(s: SamplingParams) -> gen_pb.SamplingParams:
    msg = gen_pb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def draft_cap_from_proto(req: gen_pb.GenerateRequest) -> int | None:
    """The request's cap on draft tokens per step (speculation.max_draft_tokens), checked; None when unset."""
    if not req.HasField("speculation") or not req.speculation.HasField("max_draft_tokens"):
        return None
    return check_max_draft_tokens(req.speculation.max_draft_tokens)


def set_draft_cap(req: gen_pb.GenerateRequest, cap: int | None) -> None:
    """Put a checked cap on the request (None leaves speculation unset: the server's choice)."""
    if cap is not None:
        req.speculation.max_draft_tokens = cap


def check_request_shape(req: gen_pb.GenerateRequest, served_model: str) -> None:
    """What can be checked without a tokenizer."""
    if len(req.request_id) > MAX_REQUEST_ID:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID} characters", len(req.request_id))
    if req.model and req.model != served_model:
        raise InvalidArgument("model", f"unknown model; this server serves {served_model!r}", req.model)
    if bool(req.prompt) == bool(req.prompt_token_ids):
        raise InvalidArgument("prompt", "exactly one of prompt and prompt_token_ids must be set")
    if len(req.prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgument("prompt", f"at most {MAX_PROMPT_CHARS} characters", len(req.prompt))
    if req.chat and not req.prompt:
        raise InvalidArgument("chat", "needs a text prompt")
    draft_cap_from_proto(req)
