"""What a token-tree pass of the default int8 draft costs against its one-token step, on one thread.

Fanout's branches (draft_server.fanout) and AdaServe's beam trees (draft_server.tree_draft) draft in tree passes: a
branch's token sits past the chain's, and its mask hides the chain from it. Each round times, in turn: a
one-token step, a one-token branch pass past a 3-token chain, a tree pass of 3 sibling tokens, and a 3-token chain
pass, all after a 300-token context (the KV put back after each). The draft loads as the draft server loads it,
one thread, as a draft server with a core of its own runs. Run it alone, on one core:

    taskset -c 1 python -m benchmarks.probes.draft_tree_pass --rounds 30 --out FILE.json
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import rounds_args, write_result

CONTEXT = 300
CHAIN = [7, 8, 9]  # the chain past the root that a branch must not see


def main() -> None:
    args = rounds_args(__doc__, 30, "timing every pass once")
    from benchmarks.meta import result_meta
    from starjar.model.default_pair import build_default_pair
    from starjar.model.loading import load_model

    started = time.perf_counter()
    torch.set_num_threads(1)
    draft = load_model(build_default_pair()["draft"])
    cache = draft.new_cache()
    slot = cache.allocate()
    context = [100 + i % 5000 for i in range(CONTEXT)]
    draft.forward(cache, [slot], [context], [[CONTEXT - 1]])
    draft.forward(cache, [slot], [CHAIN], [[len(CHAIN) - 1]])
    held = cache.lengths[slot]
    cached = len(CHAIN) + 1  # the tree region: the context's last token (its root) and the chain

    def passes():
        return {
            "step": lambda: draft.forward(cache, [slot], [[5]], [[0]]),
            "branch": lambda: draft.forward(cache, [slot], [[5]], [[0]], trees=[(cached, [-1] + [0] * cached)]),
            "tree3": lambda: draft.forward(cache, [slot], [[5, 6, 11]], [[0, 1, 2]],
                                           trees=[(cached, [-1] + [0] * (cached + 2))]),
            "chain3": lambda: draft.forward(cache, [slot], [[5, 6, 11]], [[0, 1, 2]]),
        }

    ways = passes()
    spent: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        for i in range(args.rounds + 2):  # two warm-up rounds
            for name, run in ways.items():
                t0 = time.perf_counter()
                run()
                took = time.perf_counter() - t0
                cache.truncate(slot, held)
                if i >= 2:
                    spent[name].append(took)
    ms = {name: round(statistics.median(v) * 1e3, 3) for name, v in spent.items()}
    result = {"draft": build_default_pair()["draft"], "context": CONTEXT, "threads": 1, "pass_ms": ms,
              "over_step": {name: round(v / ms["step"], 3) for name, v in ms.items()},
              "meta": result_meta(benchmark="draft_tree_pass", wall_s=round(time.perf_counter() - started, 1))}
    write_result(args.out, result, "ms a pass: " + ", ".join(f"{k} {v}" for k, v in ms.items()))


if __name__ == "__main__":
    main()
