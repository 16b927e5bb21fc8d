"""Tiny random-weight causal LMs and a small byte-level tokenizer, made on the fly.

Tests and smoke runs use these instead of downloading anything. Weights are
random but seeded, so a (family, seed) pair always yields the same model.
"""

from __future__ import annotations

from pathlib import Path

import torch

_CORPUS = """\
Speculative decoding lets a small draft model propose several tokens that a large target
model verifies in one forward pass. The output is exactly what the target would produce.
Write a short story about a lighthouse keeper who finds a message in a bottle.
Explain the difference between a process and a thread in an operating system.
What are the health benefits of drinking green tea every day? Give three reasons.
Translate the following sentence into French: the weather is nice today.
Solve for x: 3x + 7 = 22. Show every step of your reasoning.
def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)
Summarize the main causes of the First World War in a few sentences.
The quick brown fox jumps over the lazy dog; 0123456789 !?.,;:'"()[]{}<>/\\|@#$%^&*-+=_~`
"""

FAMILIES = ("llama", "qwen2", "gpt2")


def make_tokenizer(out_dir: str | Path, vocab_size: int = 384, extra_corpus: str = ""):
    """A byte-level BPE tokenizer (any text encodes) with <|bos|>, <|eos|>, <|pad|> specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS, extra_corpus], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
    fast.save_pretrained(out_dir)
    return fast


def make_tiny_model(out_dir: str | Path, family: str = "llama", seed: int = 0, layers: int = 2,
                    hidden: int = 64, tokenizer_vocab: int = 384, max_context: int = 512,
                    tokenizer_from: str | Path | None = None) -> Path:
    """Write a tiny random causal LM (and its tokenizer) to out_dir and return the path.

    tokenizer_from: copy an existing tokenizer directory instead of training one, so a
    target and its draft share token ids.
    """
    from transformers import (
        AutoTokenizer,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer_from, local_files_only=True)
        tok.save_pretrained(out)
    else:
        tok = make_tokenizer(out, vocab_size=tokenizer_vocab)
    vocab = len(tok)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=max_context, tie_word_embeddings=True, **ids)
        model = LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=max_context, tie_word_embeddings=False, **ids)
        model = Qwen2ForCausalLM(cfg)
    elif family == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_context,
                         **ids)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(f"family must be one of {FAMILIES}")
    # Larger weights than the default init give peaked, varied distributions, so greedy
    # paths are not dominated by near-ties and acceptance is not trivially 0 or 1.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15 if "emb" in name or "wte" in name else 0.08)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    return out
