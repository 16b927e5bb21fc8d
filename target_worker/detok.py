"""Incremental detokenisation: text deltas that never split a multi-byte character.

Decoding the whole output at every step would cost O(n) per token. Only a short
window is decoded instead: the tokens since the last emitted boundary, with a
few tokens before it as context (a token's text can depend on its neighbours,
e.g. a leading space or a byte-level character split across tokens).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if not final and text.endswith("\ufffd"):
            return ""  # a character is still incomplete: wait for its next byte
        if len(text) <= len(before):
            return ""
        delta = text[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return delta
