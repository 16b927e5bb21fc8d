"""Where a draft round's time goes on the draft server's engine: the default pair's int8 draft in
this process, one torch thread (as `starjar serve draft` runs in `bench adaserve`), one sequence in steady
state (two new verified tokens per round). Prints per round: its passes (the catch-up pass and the later
ones) and the tree's own bookkeeping; one forward of the draft and of the target at 1-4 tokens for scale;
then a torch.profiler table of 10 tree rounds. Run it under the CPU lock:

    flock /tmp/starjar-cpu.lock python benchmarks/probes/profile_draft_round.py [--depth 4 --width 2]
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = (("tree", None, None), ("chain g3", 3, 0), ("tree d3 w3", 3, 3))


def _rounds(eng, depth: int, width: int, n: int, verified: list[int]) -> list[float]:
    """n rounds of sequence 1, each after two more verified tokens (any tokens: only the time is read)."""
    from starjar.spec.proposer import DraftRequest

    out = []
    for _ in range(n):
        start = len(verified)
        new = [verified[-1] % 1000 + 17, verified[-1] % 1000 + 29]
        verified += new
        t0 = time.perf_counter()
        eng.propose([DraftRequest(1, start, new, depth, width)])
        out.append(time.perf_counter() - t0)
    return out


def _engine(draft, prompt: list[int], depth: int, width: int):
    from draft_server.engine import DraftEngine
    from starjar.spec.proposer import DraftRequest

    eng = DraftEngine(draft)
    verified = list(prompt)
    eng.propose([DraftRequest(1, 0, verified, depth, width)])  # the prompt's prefill
    _rounds(eng, depth, width, 5, verified)  # warm
    return eng, verified


def round_costs(draft, prompt: list[int], depth: int, width: int, n: int = 20) -> str:
    eng, verified = _engine(draft, prompt, depth, width)
    s = eng.stats
    c0, st0, p0, e0, j0 = s.catchup_s, s.step_s, s.passes, s.tree_expand_s, s.tree_jobs
    ts = _rounds(eng, depth, width, n, verified)
    ms = 1e3 / n
    tree = (s.tree_expand_s - e0) / max(1, s.tree_jobs - j0) * 1e3
    return (f"round {sum(ts) * ms:.1f} ms (min {min(ts) * 1e3:.1f}): {(s.passes - p0) / n:.1f} passes, catch-up pass "
            f"{(s.catchup_s - c0) * ms:.1f} ms, later passes {(s.step_s - st0) * ms:.1f} ms, tree bookkeeping "
            f"{tree:.2f} ms")


def forward_ms(model, prompt: list[int], k: int, repeats: int = 12) -> float:
    """One pass of k tokens after the prompt (the middle of `repeats` runs)."""
    cache = model.new_cache()
    slot = cache.allocate("profile")
    model.forward(cache, [slot], [prompt], [[len(prompt) - 1]])
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.forward(cache, [slot], [[5] * k], [[k - 1]])
        ts.append(time.perf_counter() - t0)
        cache.truncate(slot, len(prompt))
    ts = sorted(ts)[2:-2]
    return 1e3 * sum(ts) / len(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=int, default=2)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import prompt_ids
    from starjar.model.default_pair import build_default_pair
    from starjar.model.loading import load_model

    torch.set_num_threads(1)
    pair = build_default_pair()
    draft, target = load_model(pair["draft"], what="draft"), load_model(pair["target"], what="target")
    prompt = prompt_ids(draft.tokenizer, 1)[0]
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, 1 torch thread, prompt {len(prompt)} tokens")
    for name, depth, width in SHAPES:
        d, w = depth or args.depth, args.width if width is None else width
        print(f"{name} d{d} w{w}: {round_costs(draft, prompt, d, w)}")
    for label, m in (("draft", draft), ("target", target)):
        print(f"{label} forward of 1..4 tokens: " + ", ".join(f"{forward_ms(m, prompt, k):.1f}" for k in range(1, 5))
              + " ms")
    eng, verified = _engine(draft, prompt, args.depth, args.width)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = sum(_rounds(eng, args.depth, args.width, 10, verified))
    ops = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    print(f"10 tree rounds under the profiler: {wall * 1e3:.0f} ms wall, {ops * 1e3:.0f} ms in torch ops "
          f"({100 * ops / wall:.0f}%; the rest: Python between the ops and the profiler's own cost)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
