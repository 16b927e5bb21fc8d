"""Incremental detokenisation: text deltas that never split a multi-byte character."""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out

    def push(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")  # wait for the rest of the character
        delta = text[self.emitted:]
        self.emitted = max(self.emitted, len(text))
        return delta
