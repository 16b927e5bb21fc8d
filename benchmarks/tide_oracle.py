"""`starjar bench tide-oracle`: could online adaptation pay at all with this pair on this machine?

An upper bound, measured offline, per draft candidate of the default pair (the
int8 copy of the target, and the target's first 12 and first 4 layers):

1. acceptance before adaptation: next-token agreement of the draft with the
   target's own greedy outputs (MAX_NEW tokens after each prompt of a
   category; the target runs through starjar's own engine, so these are its
   exact greedy tokens), over the generated positions of held-out prompts;
2. acceptance after an ORACLE adaptation: the adapter serving uses
   (draft_server.tide.trainer.LowRankLogits on the draft's last hidden state),
   trained generously (a grid of ranks and learning rates, many full passes)
   on the same category's target outputs, scored on that category's held-out
   prompts, keeping the best checkpoint ON the held-out set (optimistic on
   purpose: an online trainer sees less data, later, and must choose blind);
3. costs on this machine, with the bench's thread counts (one torch thread):
   the target's pass over 1..GAMMA_MAX+1 tokens (logits on every row, as a
   verification) and the draft's one-token pass (one logit row), at batch 1
   and at the drift bench's concurrency;
4. the standard speculative model: tokens per target step
   S(a, g) = (1 - a^(g+1)) / (1 - a) / (g c + V(g+1)), c = D(1)/T(1),
   V(n) = T(n)/T(1), S(a, 0) = 1; the best gamma (0 included) before and after
   adaptation, and the ratio: the most tokens/s adaptation could add, at
   oracle quality, with no cost for training and none for the wire. Also at
   the drift bench's fixed gamma 3.

Run it under the CPU lock: `flock /tmp/starjar-cpu.lock starjar bench tide-oracle --out F.json`.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import pair_dirs
from benchmarks.tide import CONCURRENCY, GAMMA, MAX_NEW, PROMPT_CAP, layer_skip_draft
from controller.tuning.scoring import round_speedup
from draft_server.tide.trainer import LowRankLogits
from starjar.model.loading import LoadedModel, load_model
from starjar.spec.sampling import SamplingParams

CATEGORIES = ("translation", "qa", "math_reasoning")
# Per category: all 80 Spec-Bench prompts (--quick: 12 and 4). qa and math_reasoning outputs often end early (raw
# question text, as bench tide sends): about 10 and 18 generated tokens a prompt against translation's 64.
TRAIN_PROMPTS, HELD_PROMPTS = 60, 20
RANKS, LRS = (8, 64), (0.0003, 0.001, 0.003)  # 0.01 lost to 0.003 in a first run; the int8 draft wants small steps
STEPS, BATCH, EVAL_EVERY = 300, 64, 25  # per (rank, lr); the best held-out checkpoint is kept
GAMMA_MAX = 6
CONTEXT = 200  # tokens in the cache before a timed pass (a prompt's worth)


def _prompts(tokenizer, n: int, args=None) -> dict[str, list[list[int]]]:
    """Up to n prompts per category (Spec-Bench has 80 each: --dataset spec-bench; starjar's own set fewer)."""
    from benchmarks.common import prompt_texts

    out: dict[str, list[list[int]]] = {c: [] for c in CATEGORIES}
    for p in prompt_texts(args, None, categories=set(CATEGORIES)):
        if len(out[p.category]) < n:
            out[p.category].append(list(tokenizer(p.text)["input_ids"])[:PROMPT_CAP])
    return out


def _continuations(target: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """The target's exact greedy outputs (starjar's engine, no draft), up to EOS or MAX_NEW tokens."""
    from controller.colocated import colocated_engine

    reqs = colocated_engine(target, None, 0, 8).generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    return [r.output_ids for r in reqs]


@torch.no_grad()
def _positions(draft: LoadedModel, seqs: list[tuple[list[int], list[int]]],
               width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's last hidden state at each position whose next token the target generated, and that token."""
    hs, labels = [], []
    for prompt, out in seqs:
        tokens = list(prompt) + list(out)
        cache = draft.new_cache()
        h = draft.hidden_states(cache, [cache.allocate()], [tokens[:-1]])[0, len(prompt) - 1:]
        hs.append(h.float())
        labels += tokens[len(prompt):]
    h, y = torch.cat(hs), torch.tensor(labels)
    keep = y < width  # a restricted head cannot propose past its vocabulary
    return h[keep], y[keep]


@torch.no_grad()
def _agreement(base: torch.Tensor, h: torch.Tensor, y: torch.Tensor, adapter=None) -> float:
    logits = base if adapter is None else base + adapter(h)
    return float((logits.argmax(-1) == y).float().mean())


def _train_one(h, y, base, held, rank: int, lr: float, steps: int, seed: int = 0) -> tuple[float, int]:
    """Adam on cross-entropy over the whole vocabulary (as serving trains), scored on held out every
    EVAL_EVERY steps; returns the best held-out agreement and its step."""
    gen = torch.Generator().manual_seed(seed)
    ad = LowRankLogits(h.shape[1], base.shape[1], rank, gen)
    opt = torch.optim.Adam(ad.parameters(), lr=lr, weight_decay=1e-4)
    best, at = -1.0, 0
    for step in range(1, steps + 1):
        idx = torch.randint(len(y), (min(BATCH, len(y)),), generator=gen)
        with torch.enable_grad():
            loss = F.cross_entropy(base[idx] + ad(h[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if step % EVAL_EVERY == 0:
            score = _agreement(held[2], held[0], held[1], ad)
            if score > best:
                best, at = score, step
    return best, at


def _oracle(draft: LoadedModel, train: list, held: list, steps: int) -> dict:
    width = int(draft.head_logits(torch.zeros(1, draft.model.config.hidden_size), adapted=False).shape[1])
    h, y = _positions(draft, train, width)
    hh, hy = _positions(draft, held, width)
    with torch.no_grad():
        base_train = draft.head_logits(h.to(draft.dtype), adapted=False)
        base_held = draft.head_logits(hh.to(draft.dtype), adapted=False)
    before = _agreement(base_held, hh, hy)
    grid = {}
    for rank in RANKS:
        for lr in LRS:
            grid[f"rank{rank}_lr{lr:g}"] = _train_one(h, y, base_train, (hh, hy, base_held), rank, lr, steps)
    name, (best, step) = max(grid.items(), key=lambda kv: kv[1][0])
    return {"train_positions": len(y), "held_out_positions": len(hy), "agreement_before": round(before, 4),
            "agreement_oracle_adapter": round(best, 4), "oracle_config": name, "oracle_step": step,
            "agreement_oracle": round(max(before, best), 4),  # a gate that only swaps in improvements
            "grid": {k: {"agreement": round(v[0], 4), "step": v[1]} for k, v in grid.items()}}


@torch.no_grad()
def _pass_ms(model: LoadedModel, batch: int, k: int, rows: int, repeats: int = 15) -> float:
    """Median ms of one pass feeding k tokens to each of `batch` sequences of CONTEXT tokens, with `rows`
    logit rows per sequence (the last ones)."""
    cache = model.new_cache()
    slots = [cache.allocate(f"s{b}") for b in range(batch)]
    ctx = [[(7 * i + 13 * b) % 5000 + 100 for i in range(CONTEXT)] for b in range(batch)]
    model.forward(cache, slots, ctx, [[CONTEXT - 1]] * batch)
    ts = []
    for r in range(repeats + 2):
        t0 = time.perf_counter()
        fed = [[(r + i) % 900 + 50 for i in range(k)]] * batch
        model.forward(cache, slots, fed, [list(range(k - rows, k))] * batch)
        ts.append(time.perf_counter() - t0)
        for s in slots:
            cache.truncate(s, CONTEXT)
    return 1e3 * statistics.median(ts[2:])


def _costs(target: LoadedModel, drafts: dict[str, LoadedModel]) -> dict:
    out = {}
    for batch in sorted({1, CONCURRENCY}):
        t = [_pass_ms(target, batch, k, k) for k in range(1, GAMMA_MAX + 2)]
        row = {"target_verify_ms_by_tokens": [round(x, 2) for x in t],
               "verify_ratio_by_tokens": [round(x / t[0], 4) for x in t], "draft": {}}
        for name, d in drafts.items():
            dm = _pass_ms(d, batch, 1, 1)
            row["draft"][name] = {"draft_step_ms": round(dm, 2), "c": round(dm / t[0], 4)}
        out[f"batch{batch}"] = row
    return out


def speedup(a: float, g: int, c: float, verify_ratio: list[float]) -> float:
    """Tokens per target-step time: expected tokens of a round over its cost in target steps (every draft pass,
    the first included, costs c)."""
    return round_speedup(a, g, c, c, verify_ratio)


def best_gamma(a: float, c: float, verify_ratio: list[float]) -> tuple[int, float]:
    return max(((g, speedup(a, g, c, verify_ratio)) for g in range(len(verify_ratio))), key=lambda x: x[1])


def agreement_for(target: float, c: float, verify_ratio: list[float]) -> float | None:
    """The least agreement (to 0.001) whose best-gamma speedup reaches `target`; None if even 1.0 does not."""
    for i in range(1001):
        if best_gamma(i / 1000, c, verify_ratio)[1] >= target:
            return i / 1000
    return None


def _model_rows(agreements: dict, costs: dict) -> dict:
    rows = {}
    for batch, cost in costs.items():
        v = cost["verify_ratio_by_tokens"]
        for name, per_cat in agreements.items():
            c = cost["draft"][name]["c"]
            for cat, r in per_cat.items():
                a0, a1 = r["agreement_before"], r["agreement_oracle"]
                (g0, s0), (g1, s1) = best_gamma(a0, c, v), best_gamma(a1, c, v)
                f0, f1 = speedup(a0, GAMMA, c, v), speedup(a1, GAMMA, c, v)
                rows[f"{batch}/{name}/{cat}"] = {
                    "best_gamma_before": g0, "speedup_before": round(s0, 4),
                    "best_gamma_oracle": g1, "speedup_oracle": round(s1, 4),
                    "adaptation_ratio_best_gamma": round(s1 / s0, 4),
                    f"speedup_gamma{GAMMA}_before": round(f0, 4), f"speedup_gamma{GAMMA}_oracle": round(f1, 4),
                    f"adaptation_ratio_gamma{GAMMA}": round(f1 / f0, 4),
                    "agreement_needed_for_1.05x_best_gamma": agreement_for(1.05 * s0, c, v),
                    "speedup_at_agreement_1": round(best_gamma(1.0, c, v)[1], 4)}
    return rows


def _candidates(args, target_dir: str) -> dict[str, str]:
    _, int8_dir, _ = pair_dirs(args)
    return {"int8": int8_dir, "first12layers": layer_skip_draft(target_dir, 12),
            "first4layers": layer_skip_draft(target_dir, 4)}


def run(args) -> dict:
    n_train, n_held = (12, 4) if args.quick else (TRAIN_PROMPTS, HELD_PROMPTS)
    steps = 200 if args.quick else STEPS
    target_dir, _, _ = pair_dirs(args)
    target = load_model(target_dir)
    dirs = _candidates(args, target_dir)
    drafts = {name: load_model(d, what="draft") for name, d in dirs.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # costs first, as the drift bench runs them: target and draft server one thread each
    print("tide-oracle: pass costs ...", file=sys.stderr)
    costs = _costs(target, drafts)
    torch.set_num_threads(threads)  # agreements do not depend on the thread count
    prompts = _prompts(target.tokenizer, n_train + n_held, args)
    data = {}
    for cat in CATEGORIES:
        print(f"tide-oracle: target outputs for {cat} ...", file=sys.stderr)
        seqs = list(zip(prompts[cat], _continuations(target, prompts[cat]), strict=True))
        cut = len(seqs) * n_train // (n_train + n_held)  # the same split on a set smaller than asked for
        data[cat] = (seqs[:cut], seqs[cut:])
    agreements = {}
    for name, d in drafts.items():
        agreements[name] = {}
        for cat, (train, held) in data.items():
            print(f"tide-oracle: oracle adapter for {name} on {cat} ...", file=sys.stderr)
            agreements[name][cat] = _oracle(d, train, held, steps)
    model = _model_rows(agreements, costs)
    best = max(model.items(), key=lambda kv: kv[1]["adaptation_ratio_best_gamma"])
    return {"label": "offline upper bound for online draft adaptation: oracle adapter (best held-out checkpoint "
                     "of a rank/lr grid, trained on the same category) and the standard speculative model with "
                     "this machine's costs (1 torch thread); no training or wire cost counted",
            "pair": {"target": target_dir, "drafts": dirs}, "categories": list(CATEGORIES),
            "prompts_per_category": {"train": n_train, "held_out": n_held}, "max_new_tokens": MAX_NEW,
            "oracle_grid": {"ranks": list(RANKS), "lrs": list(LRS), "steps": steps, "batch": BATCH,
                            "eval_every": EVAL_EVERY},
            "agreement": agreements, "costs": costs, "model": model,
            "best_adaptation_ratio_best_gamma": {"row": best[0], **best[1]}}
