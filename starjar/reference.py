"""The target model decoding alone, through Hugging Face `generate()`.

This is the ground truth starjar must reproduce token for token under greedy
decoding; tests and benchmarks both compare against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from starjar.attention import stock_attention
from starjar.models import LoadedModel


@torch.no_grad()
def hf_greedy(model: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """Greedy continuation of one prompt (batch 1, no padding), up to and including EOS."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    eos = list(model.eos_token_ids) or None
    with stock_attention(model.model):  # Hugging Face's own attention, not starjar's folded one
        out = model.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=eos,
                                   pad_token_id=eos[0] if eos else 0, **generate_kwargs)
    new = out[0, ids.shape[1]:].tolist()
    for i, t in enumerate(new):  # generate() pads finished rows; cut after the first EOS
        if eos and t in eos:
            return new[: i + 1]
    return new
