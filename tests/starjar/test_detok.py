"""Streamed text deltas add up to the decoded output."""

import random

from target_worker.detok import IncrementalDetokenizer


def test_deltas_concatenate_to_the_full_decode(models):
    tok = models["llama"].tokenizer
    rng = random.Random(0)
    texts = ["Hello, world! Ünïcödé ✓ 日本語 emoji 🙂 and code: def f(x): return x**2",
             "  leading spaces\n\nand new lines\ttabs"]
    for text in texts:
        ids = tok(text)["input_ids"]
        for _ in range(20):
            d = IncrementalDetokenizer(tok)
            out, i = "", 0
            while i < len(ids):
                n = rng.randint(1, 4)
                out += d.push(ids[i:i + n], final=i + n >= len(ids))
                i += n
            assert out == tok.decode(ids, skip_special_tokens=True)
            assert "\ufffd" not in out or "\ufffd" in tok.decode(ids, skip_special_tokens=True)
