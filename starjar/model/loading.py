"""Loading causal LMs and tokenizers from local directories, and running them ragged.

Nothing here reaches a hub: every load is `local_files_only`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from starjar.cpu import few_rows, huge_pages, quantized, skinny_linear
from starjar.cpu.kernels import forced_path
from starjar.errors import InvalidArgument, ModelMismatch
from starjar.model import attention, kv_precision, smoothing
from starjar.model.cuda_graphs import GraphedDecoder
from starjar.model.kv_cache import RaggedKVCache
from starjar.model.lean_decoder import LeanDecoder
from starjar.model.lean_target import LeanTarget

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise InvalidArgument("dtype", f"one of {sorted(set(DTYPES))}", name) from None


def parse_device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise InvalidArgument("device", "must be cpu or cuda[:N]", name) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("device", "cuda requested but no CUDA device is available", name)
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgument("device", "must be cpu or cuda[:N]", name)
    return dev


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary (token -> id) and its size: equal iff draft ids mean the same to the target."""
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()
    return f"{len(vocab)}:{hashlib.sha256(blob).hexdigest()[:32]}"


@dataclass
class LoadedModel:
    """A causal LM ready for ragged passes: weights, tokenizer and what the engines need to know."""

    path: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # rows of the output layer (ids the model can emit)
    max_context: int  # longest sequence (prompt + output) the model supports
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    lean: torch.nn.Module | None = None  # starjar.model.lean_decoder.LeanDecoder for a Llama-family draft
    adapter: torch.nn.Module | None = None  # a draft's learned logit correction (TIDE); never on a target
    # A draft's training-signal tap (TIDE): told (cache, slots, counts, hidden [B, Q, hidden]) after each pass.
    hidden_tap: Callable | None = None
    # A draft that reads at most this many trailing tokens of a prompt (recipe key prompt_window; None: all).
    # Its prefill of a long prompt is then bounded: an int8 copy of the target prefills at 0.8x the target's
    # cost, so a 700-token prompt cost it over a second (AMD EPYC, AVX2). The target verifies every draft, so
    # what the draft reads changes its acceptance, never the output.
    prompt_window: int | None = None
    kv_dtype: torch.dtype | None = None  # an int8 draft's KV precision (starjar.model.kv_precision); None: dtype
    weights_from: str | None = None  # an int8 copy's float weights, resolved (recipe key weights_from)
    # A smoothed int8 copy's per-layer divisors of its values [kv_heads, head_dim] (starjar.model.smoothing).
    value_scales: list[torch.Tensor] | None = None
    # A float Llama-family model's scripted layers (a target's, or a float draft's): HF's forward to the last bit.
    lean_target: LeanTarget | None = None
    # The same float model's chain and tree passes as CUDA graphs (starjar.model.cuda_graphs).
    graphs: GraphedDecoder | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """What its KV cache holds: the int8 draft's kv_dtype, else the model's own dtype."""
        return self.kv_dtype or self.dtype

    def new_cache(self) -> RaggedKVCache:
        return RaggedKVCache(self.device, self.cache_dtype)

    @torch.no_grad()
    def forward(self, cache: RaggedKVCache, slots: list[int], tokens: list[list[int]],
                logit_rows: list[list[int]], trees: list | None = None) -> list[torch.Tensor]:
        """One ragged pass: slots[b] appends tokens[b]; returns, per b, logits [len(rows), V]
        at the requested offsets (0-based within tokens[b]). trees: per row, None or a token tree's
        (cached, parents) (a tree pass, see RaggedKVCache.begin).

        Only the requested rows go through the output layer, which on a 49k vocabulary
        is most of the cost of a short pass.
        """
        hidden = self.hidden_states(cache, slots, tokens, trees)  # [B, Q, hidden]
        # The tap keeps states per sequence position for TIDE; a tree pass's rows are beams, not positions.
        if self.hidden_tap is not None and not any(t is not None for t in trees or ()):
            self.hidden_tap(cache, slots, [len(t) for t in tokens], hidden)
        if len(logit_rows) == 1 and len(logit_rows[0]) == 1 and 0 <= logit_rows[0][0] < hidden.shape[1]:
            r = logit_rows[0][0]  # a step's one row: a view, not a gather
            return [self.head_logits(hidden[0, r:r + 1])]
        b_idx = [b for b, rows in enumerate(logit_rows) for _ in rows]
        r_idx = [r for rows in logit_rows for r in rows]
        logits = self.head_logits(hidden[b_idx, r_idx])  # [sum rows, V]
        return list(torch.split(logits, [len(r) for r in logit_rows]))

    @torch.no_grad()
    def hidden_states(self, cache: RaggedKVCache, slots: list[int], tokens: list[list[int]],
                      trees: list | None = None) -> torch.Tensor:
        """The pass of forward() without the output layer: last hidden states [B, max len, hidden]."""
        counts = [len(t) for t in tokens]
        assert min(counts) > 0
        if min(counts) == max(counts):  # one op where no row is padded (each op between passes runs cold)
            ids = torch.tensor(tokens, dtype=torch.long)
        else:
            ids = torch.zeros(len(tokens), max(counts), dtype=torch.long)
            for b, t in enumerate(tokens):
                ids[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        position_ids, mask = cache.begin(slots, counts, trees)
        if self.lean is not None:
            return self.lean.hidden(ids.to(self.device), position_ids, mask, cache, counts)
        if self.graphs is not None:
            hidden = self.graphs.hidden(ids.to(self.device), position_ids, mask, cache)
            if hidden is not None:
                return hidden
        if self.lean_target is not None:
            hidden = self.lean_target.hidden(ids.to(self.device), position_ids, mask, cache)
            if hidden is not None:
                return hidden
        return self.model.base_model(input_ids=ids.to(self.device), position_ids=position_ids,
                                     attention_mask=mask, cache=cache, use_cache=True).last_hidden_state

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor, adapted: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] in float32 (a draft's restricted head: its first V ids), plus
        the draft's online adapter (draft_server TIDE) when one is set and `adapted`. The adapter only
        reads the last hidden state, so swapping it never invalidates a KV cache."""
        head = self.lean.head if self.lean is not None and self.lean.head is not None \
            else self.model.get_output_embeddings()
        logits = head(hidden).float()
        adapter = self.adapter  # read once: a swap between two reads must not mix two adapters
        if adapted and adapter is not None:
            logits = logits + adapter(hidden.float())
        return logits


# What each int8 draft this process loaded ran with (benchmark JSONs name it beside the machine).
DRAFT_VARIANT_KEYS = ("int8_kernel", "head_vocab", "act_bits", "smooth_alpha", "skip_layers")
INT8_DRAFTS_LOADED: dict[str, dict] = {}


def load_model(path: str | os.PathLike, device: str = "cpu", dtype: str | torch.dtype = "float32",
               what: str = "model", variant: dict | None = None) -> LoadedModel:
    """Load a Hugging Face causal LM and its tokenizer from a local directory.

    variant: recipe keys that override the directory's starjar.json for this load (an int8 draft's
    int8_kernel, head_vocab and skip_layers: how `starjar models build` tries its candidates)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise InvalidArgument(what, "must be a local directory with a Hugging Face config.json", str(path))
    dev, dt = parse_device(device), parse_dtype(dtype)
    recipe = {**_recipe(p), **(variant or {})}
    weights = p
    if recipe.get("kind") == quantized.KIND:
        weights = (p / recipe["weights_from"]).resolve()
        if dev.type != "cpu" or dt != torch.float32:
            raise InvalidArgument(what, f"an int8 draft runs on cpu in float32 (asked {dev}, {dt})", str(path))
    tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(weights, local_files_only=True, dtype=dt).to(dev).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    lean, kv_dtype, value_scales = None, None, None
    if recipe.get("kind") == quantized.KIND:
        leaner = LeanDecoder.supports(model)  # a draft's proposals may differ in the last bits; a target's may not
        act_bits = _act_bits(recipe, what, p)  # checked before smoothing's calibration passes
        kv_choice = kv_precision.recipe_choice(recipe.get("kv_dtype"), what, str(p))  # likewise
        value_scales = _smooth(model, tokenizer, recipe, what, p)
        if leaner:
            LeanDecoder.attach_fused(model, recipe.get("head_vocab"))
        model = quantized.quantize_int8(model, recipe.get("int8_kernel"), act_bits)
        INT8_DRAFTS_LOADED[str(p)] = {**{k: recipe.get(k) for k in DRAFT_VARIANT_KEYS}, "act_bits": act_bits,
                                      "int8_kernel": forced_path() or recipe.get("int8_kernel")}  # as it ran
        if leaner:
            lean = LeanDecoder(model, skip=_skip_layers(recipe, model.config.num_hidden_layers, what, p))
            kv_dtype = kv_precision.draft_kv_dtype(kv_choice)
        elif recipe.get("skip_layers"):
            raise InvalidArgument(what, "skip_layers needs a Llama-family draft (the lean forward)", str(p))
        elif kv_choice not in (None, "float32"):
            raise InvalidArgument(what, "kv_dtype other than float32 needs a Llama-family draft (the lean forward)",
                                  str(p))
        INT8_DRAFTS_LOADED[str(p)]["kv_dtype"] = str(kv_dtype or dt).removeprefix("torch.")
    elif dev.type == "cpu":
        _place_float_weights(model, dt)
    attention.install(model)  # grouped-query heads folded onto their KV head: no K/V copies per pass
    lean_target, graphs = _float_passes(model, dev) if recipe.get("kind") != quantized.KIND else (None, None)
    cfg = model.config
    max_ctx = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.eos_token_id
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and gen_cfg.eos_token_id is not None:
        eos = gen_cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    log.info("loaded %s from %s (%s, %s, vocab %d, context %d)", what, p, dev, dt, vocab, max_ctx)
    window = recipe.get("prompt_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise InvalidArgument(what, "prompt_window in starjar.json must be a positive integer", window)
    return LoadedModel(str(p), model, tokenizer, dev, dt, vocab, int(max_ctx), eos_ids,
                       tokenizer_fingerprint(tokenizer), lean, prompt_window=window, kv_dtype=kv_dtype,
                       weights_from=str(weights) if weights != p else None, value_scales=value_scales,
                       lean_target=lean_target, graphs=graphs)


def _place_float_weights(model: torch.nn.Module, dt: torch.dtype) -> None:
    """A float model on the CPU: its weights in huge pages (the same values), and this machine's fastest
    few-row products for them (measured once, cached)."""
    huge_pages.rehome(model)
    if dt == torch.float32 and skinny_linear.install(model):
        few_rows.settle_stream([m.weight for m in model.modules() if type(m) is torch.nn.Linear])
        skinny_linear.choose(model)


def _float_passes(model: torch.nn.Module, dev: torch.device) -> tuple[LeanTarget | None, GraphedDecoder | None]:
    """A float model's passes (an int8 draft runs LeanDecoder's): its scripted layers, whose choices are
    measured for CPUs, and its CUDA graphs, which take those passes on a GPU (and forced, on a CPU)."""
    lean_target = _lean_target(model) if dev.type == "cpu" else None
    return lean_target, GraphedDecoder(model) if LeanTarget.supports(model) else None


def _lean_target(model: torch.nn.Module) -> LeanTarget | None:
    """A float Llama-family model's scripted layers, with which pass classes run them here (measured once per
    machine, cached), or None for a model they do not reproduce."""
    if not LeanTarget.supports(model):
        return None
    try:
        lean = LeanTarget(model)  # compiles its layers once per process
    except (RuntimeError, torch.jit.frontend.NotSupportedError) as exc:  # a torch whose TorchScript lacks an op
        log.warning("lean target forward unavailable (%s): running Hugging Face's", type(exc).__name__)
        return None
    lean.settle()
    return lean


def _skip_layers(recipe: dict, layers: int, what: str, p: Path) -> tuple[int, ...]:
    """The recipe's skip_layers, checked: distinct layer indices, at least one layer left."""
    skip = recipe.get("skip_layers") or []
    if not isinstance(skip, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                         for i in skip) or len(set(skip)) != len(skip) or len(skip) >= layers:
        raise InvalidArgument(what, f"skip_layers in starjar.json must list distinct layers in [0, {layers}) and "
                                    "leave at least one", f"{p}: {skip}")
    return tuple(skip)


def _act_bits(recipe: dict, what: str, p: Path) -> int:
    bits = recipe.get("act_bits")
    if bits is None:
        return 7
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in quantized.ACT_BITS:
        raise InvalidArgument(what, f"act_bits in starjar.json must be one of {quantized.ACT_BITS}", f"{p}: {bits}")
    return bits


def _smooth(model, tokenizer, recipe: dict, what: str, p: Path) -> list | None:
    """The recipe's smooth_alpha, checked and folded into the float weights before they are quantized; the
    per-layer divisors of the values (smoothing.smooth), None unsmoothed."""
    if recipe.get("smooth_alpha") is None:
        return None
    alpha = smoothing.check_alpha(recipe["smooth_alpha"], what, p)
    if not smoothing.supports(model):
        raise InvalidArgument(what, "smooth_alpha needs a Llama-family draft (llama, qwen2, mistral)", str(p))
    return smoothing.smooth(model, tokenizer, alpha)


def _recipe(p: Path) -> dict:
    """starjar.json beside a model says how it was built (and, for int8 drafts, how to load it)."""
    f = p / "starjar.json"
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must speak the target's token ids, or its proposals are noise (and may be out of range)."""
    if draft.fingerprint != target.fingerprint:
        raise ModelMismatch("draft", f"tokenizer must equal the target's (target {target.fingerprint}, "
                            f"draft {draft.fingerprint})")
    if draft.vocab_size > target.vocab_size:
        raise ModelMismatch("draft", f"vocabulary must be <= the target's {target.vocab_size}", draft.vocab_size)


def kv_bytes_per_token(model: LoadedModel) -> int:
    """KV cache bytes one token costs (keys and values, every layer)."""
    cfg = model.model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * model.cache_dtype.itemsize
