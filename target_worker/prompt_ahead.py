"""New prompts sent to the draft before the target prefills them, so that the two prefills run side by side.

A remote draft server with lookahead on feeds tokens it is sent with gamma 0 in its idle time
(draft_server.lookahead); the target's own prefill of the prompt then hides the draft's. A sequence whose
prompt went ahead starts its first real round past it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starjar.spec.proposer import DraftRequest
from target_worker.request import Request

# (the prompts as rounds with gamma 0) -> whether each went
SendAhead = Callable[[Sequence[DraftRequest]], list[bool]]


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
