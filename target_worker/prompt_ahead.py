"""New prompts to the draft without a round of their own: sent before the target prefills them (a remote
draft), or handed over with the KV the target's prefill wrote (an int8 copy of the target, co-located or on a
draft server that advertised the target's weights).

A remote draft server with lookahead on feeds tokens it is sent with gamma 0 in its idle time
(draft_server.lookahead); the target's own prefill of the prompt then hides the draft's. A sequence whose
prompt went ahead starts its first real round past it. A co-located draft that shares the target's attention
shapes (starjar.model.prompt_kv) takes the prompt's KV from the target's cache instead of prefilling it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

from starjar.spec.proposer import DraftRequest
from target_worker.request import Request

log = logging.getLogger(__name__)

# (the prompts as rounds with gamma 0) -> whether each went
SendAhead = Callable[[Sequence[DraftRequest]], list[bool]]
# (the draft's key for a sequence, its prompt, per layer (K, V) of the prompt) -> the prompt tokens the draft took
SeedDraft = Callable[[Hashable, Sequence[int], list], int]


def send_prompts_ahead(send: SendAhead | None, joined: Sequence[Request]) -> None:
    """Before the target prefills `joined`: the new ones' prompts to the draft (a preempted request coming
    back, or one the draft already holds, goes as it did)."""
    new = [r for r in joined if not r.output_ids and not r.draft_synced] if send is not None else []
    if not new:
        return
    went = send([DraftRequest(r.draft_key, 0, r.prompt_ids, 0) for r in new])
    for r, ok in zip(new, went, strict=True):
        if ok:
            r.draft_synced = len(r.prompt_ids)


def seed_prompts(seed: SeedDraft | None, cache, joined: Sequence[Request], fed: dict[int, list[int]]) -> None:
    """After the target prefilled `joined` (fed: what each was fed, by id): the new ones' prompts to a
    co-located draft with the KV the target wrote. A request capped at no drafts is left out."""
    if seed is None:
        return
    for r in joined:
        tokens = fed[id(r)]
        if r.finished or r.draft_synced or r.max_draft_tokens == 0 or not tokens:  # finished: its KV is gone
            continue
        try:
            took = seed(r.draft_key, tokens, cache.prefix(r.slot, len(tokens)))
        except Exception as exc:  # the draft is an optimisation: its first round prefills the prompt instead
            log.warning("handing a prompt's KV to the draft failed: %s", exc)
            continue
        if took:  # the draft holds the prompt: only the tokens past it are a catch-up (Request.draft_lag)
            r.draft_synced = r.spec_through = took
