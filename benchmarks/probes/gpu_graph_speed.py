"""The graphed decoder (starjar.model.cuda_graphs) on a GPU against HF's forward: target alone and speculative.

No weights travel to a GPU machine that reaches no hub, so the pair is made where it runs: a target with the
default target's shapes (SmolLM2-135M-Instruct: 30 layers, 576 wide, 9 query and 3 KV heads, a 49152-token
vocabulary) and seeded random weights, and a draft made of the target's first --draft-layers layers, with
the target's later layers damped (their output products scaled by --damp) so that the draft agrees with it
about as often as a trained draft does. A step's cost depends on the shapes, not the weights; the acceptance
reached is printed beside every speculative figure.

In interleaved turns (--repeats): HF generate() alone at batch 1, and starjar's engine with the graphs off
(HF's forward) and on, the target alone at each --batch-sizes and speculative at batch 1 for each --gammas.
Prints tokens/s, the ratios, and whether every engine output begins with HF generate()'s greedy output.

    python -m benchmarks.probes.gpu_graph_speed --out F.json        (on a CUDA machine)
    python -m benchmarks.probes.gpu_graph_speed --device cpu --small (a smoke run of the probe itself)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.fixtures.reference import hf_greedy
from benchmarks.fixtures.tiny_models import make_tokenizer
from benchmarks.meta import result_meta
from controller.colocated import colocated_engine
from starjar import workloads
from starjar.model.cuda_graphs import ENV
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams

# The default target's shapes; --small: a model the CPU runs in seconds, for a run of the probe itself.
SHAPES = {"full": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0),
          "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=384, rope_theta=10000.0)}


CONTEXT = 8192  # the tiny tokenizer spends a token on every few bytes: the longest own prompt is 2.1k tokens


def make_pair(root: Path, shapes: dict, draft_layers: int, damp: float, seed: int = 0) -> tuple[str, str]:
    """The target (random, seeded, its layers past draft_layers damped) and the draft of its first layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(root / "target", vocab_size=384)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**shapes, max_position_embeddings=CONTEXT, tie_word_embeddings=True, rms_norm_eps=1e-5, **ids)
    target = LlamaForCausalLM(cfg)
    width = shapes["hidden_size"]
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() == 2:  # peaked distributions, activations of unit scale: few near-ties in greedy paths
                p.normal_(0.0, 0.15 if "embed" in name else width ** -0.5)
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    target.save_pretrained(root / "target")
    draft = LlamaForCausalLM(LlamaConfig(**{**shapes, "num_hidden_layers": draft_layers},
                                         max_position_embeddings=CONTEXT, tie_word_embeddings=True,
                                         rms_norm_eps=1e-5, **ids))
    draft.load_state_dict(target.state_dict(), strict=False)  # the first layers, embeddings and final norm
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


def _engine_run(target, draft, prompts, gamma: int, batch: int, max_new: int, graphs: bool):
    """Tokens/s of one engine run, its outputs and its acceptance (gamma 0: the target alone)."""
    os.environ[ENV] = "1" if graphs else "0"
    engine = colocated_engine(target, draft if gamma else None, gamma, batch)
    _sync(target)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    _sync(target)
    wall = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in reqs) / wall, [r.output_ids for r in reqs], engine.stats.acceptance_rate


def _hf_run(target, prompts, max_new: int) -> float:
    """Tokens/s of HF generate() over the prompts one at a time (its own forward and cache)."""
    _sync(target)
    t0 = time.perf_counter()
    n = sum(len(hf_greedy(target, p, max_new, min_new_tokens=max_new)) for p in prompts)
    _sync(target)
    return n / (time.perf_counter() - t0)


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--small", action="store_true", help="a tiny model: a run of the probe itself")
    ap.add_argument("--gammas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--prompts", type=int, default=8, help="prompts at batch 1 (batches take max(this, batch))")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--damp", type=float, default=0.02, help="the target's later layers' output scale (0.02: "
                    "acceptance about 0.9 at gamma 4, as the default pair's)")
    ap.add_argument("--keep-pair", default=None, help="make the pair in this folder (and keep it) for other runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.keep_pair or tempfile.mkdtemp(prefix="starjar-gpu-pair-"))
    t_dir, d_dir = make_pair(root, SHAPES["small" if args.small else "full"], args.draft_layers, args.damp)
    target = load_model(t_dir, args.device, args.dtype, what="target")
    draft = load_model(d_dir, args.device, args.dtype, what="draft")
    texts = workloads.load("own", max(args.prompts, *args.batch_sizes))
    prompts = [target.tokenizer(p.text)["input_ids"][: args.prompt_tokens] for p in texts]
    one = prompts[: args.prompts]
    want = [hf_greedy(target, p, args.max_new) for p in prompts]
    # Warm-up: every pass shape of the timed runs captured before the clock starts.
    for graphs in (False, True):
        for b in args.batch_sizes:
            _engine_run(target, None, prompts[: max(b, 2)], 0, b, 8, graphs)
        for g in args.gammas:
            _engine_run(target, draft, one[:2], g, 1, 16, graphs)
    runs: dict[str, list[float]] = {}
    equal: dict[str, bool] = {}
    acceptance: dict[str, float] = {}

    def timed(name: str, result) -> None:
        tps, outs, acc = result
        runs.setdefault(name, []).append(round(tps, 2))
        equal[name] = equal.get(name, True) and all(o[: len(w)] == w for o, w in zip(outs, want, strict=False))
        if "gamma" in name:
            acceptance[name] = round(acc, 3)

    for _ in range(args.repeats):
        runs.setdefault("hf_generate_b1", []).append(round(_hf_run(target, one, args.max_new), 2))
        for graphs in (False, True):
            way = "graphs" if graphs else "eager"
            for b in args.batch_sizes:
                timed(f"{way}_alone_b{b}", _engine_run(target, None, prompts[: max(b, len(one))] if b > 1 else one,
                                                       0, b, args.max_new, graphs))
            for g in args.gammas:
                timed(f"{way}_gamma{g}_b1", _engine_run(target, draft, one, g, 1, args.max_new, graphs))
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {"graphs_over_eager_alone": {b: round(med[f"graphs_alone_b{b}"] / med[f"eager_alone_b{b}"], 3)
                                          for b in args.batch_sizes},
              "graphs_alone_b1_over_hf_generate": round(med["graphs_alone_b1"] / med["hf_generate_b1"], 3),
              "spec_over_alone": {way: {g: round(med[f"{way}_gamma{g}_b1"] / med[f"{way}_alone_b1"], 3)
                                        for g in args.gammas} for way in ("eager", "graphs")},
              "graphs_spec_over_hf_generate": {g: round(med[f"graphs_gamma{g}_b1"] / med["hf_generate_b1"], 3)
                                               for g in args.gammas}}
    for k, v in med.items():
        print(f"{k}: {v:.1f} tokens/s (runs {runs[k]}){'' if k not in equal else f', HF tokens: {equal[k]}'}"
              f"{'' if k not in acceptance else f', acceptance {acceptance[k]}'}")
    print(json.dumps(ratios))
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    if args.out:
        result = {"tokens_per_s": med, "runs": runs, "ratios": ratios, "hf_tokens": equal, "acceptance": acceptance,
                  "pair": {"shapes": "small" if args.small else "SmolLM2-135M-Instruct's", "weights": "random, seeded",
                           "draft_layers": args.draft_layers, "damp": args.damp, "dtype": args.dtype},
                  "workload": {"source": "own", "prompts_b1": len(one), "prompt_tokens": args.prompt_tokens,
                               "max_new_tokens": args.max_new, "ignore_eos": True},
                  "meta": result_meta(benchmark="gpu_graph_speed", device=device, repeats=args.repeats,
                                      torch_version=torch.__version__)}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
