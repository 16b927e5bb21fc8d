"""Would a co-located int8 draft propose as well from the target's own KV cache? The default pair's draft has the
target's layers, heads and rotary, so it could attend over the keys and values the target already wrote (no
prefill of its own, no catch-up). This measures, teacher-forced on the target's greedy continuations of
Spec-Bench first turns, how often the draft's next token equals the target's:
  own       the draft's own cache (what starjar runs);
  prompt    the target's K/V for the prompt, the draft's own for the generated tokens;
  target    the target's K/V for every earlier token.
Run it alone, under the CPU lock:

    flock /tmp/starjar-cpu.lock python benchmarks/probes/measure_shared_kv.py [--prompts 8] [--tokens 32]
"""

from __future__ import annotations

import argparse

from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import load_pair
from starjar import workloads
from starjar.cpu.kernels import machine_label
from starjar.model.default_pair import build_default_pair


class _Holder:
    slot = -1


def _slot(cache) -> int:
    holder = _Holder()
    cache.allocate(holder)
    return holder.slot


def agreement(target, draft, ids: list[int], new: int) -> dict[str, tuple[int, int]]:
    """(agreeing, positions) per variant for one prompt and the target's greedy continuation of it."""
    seq = ids + hf_greedy(target, ids, new)
    first, last = len(ids), len(seq) - 1  # positions whose next token the target chose
    tcache = target.new_cache()
    tslot = _slot(tcache)
    want = target.forward(tcache, [tslot], [seq], [list(range(len(seq)))])[0].argmax(-1)
    dcache = draft.new_cache()
    own = draft.forward(dcache, [_slot(dcache)], [seq], [list(range(len(seq)))])[0].argmax(-1)
    tcache.truncate(tslot, first)  # the target's prompt K/V, then the draft writes the generated tokens'
    prompt = draft.forward(tcache, [tslot], [seq[first:]], [list(range(len(seq) - first))])[0].argmax(-1)
    tcache.truncate(tslot, first)
    target.forward(tcache, [tslot], [seq[first:]], [[0]])  # the target's K/V for every token again
    shared = []
    for i in range(first, last):
        tcache.truncate(tslot, i)
        shared.append(int(draft.forward(tcache, [tslot], [[seq[i]]], [[0]])[0][0].argmax()))
    n = last - first
    return {"own": (sum(int(own[i]) == int(want[i]) for i in range(first, last)), n),
            "prompt": (sum(int(prompt[i - first]) == int(want[i]) for i in range(first, last)), n),
            "target": (sum(s == int(want[i]) for s, i in zip(shared, range(first, last), strict=True)), n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    pair = build_default_pair()
    target, draft = load_pair(pair["target"], pair["draft"])
    print(machine_label(), flush=True)
    totals: dict[str, list[int]] = {}
    for p in workloads.texts(workloads.load("own", args.prompts)):
        for name, (hit, n) in agreement(target, draft, list(target.tokenizer(p)["input_ids"]), args.tokens).items():
            acc = totals.setdefault(name, [0, 0])
            acc[0], acc[1] = acc[0] + hit, acc[1] + n
        print("  ".join(f"{k} {h / n:.3f}" for k, (h, n) in totals.items()), f"({totals['own'][1]} positions)",
              flush=True)


if __name__ == "__main__":
    main()
