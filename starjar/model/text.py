"""Prompt text to token ids, the same way everywhere (CLI, servers, benchmarks)."""

from __future__ import annotations

from starjar.errors import InvalidArgument


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Tokenizer defaults (special tokens included); with chat, one user message and the generation prompt."""
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("chat", "the model's tokenizer has no chat template")
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return list(out["input_ids"])
