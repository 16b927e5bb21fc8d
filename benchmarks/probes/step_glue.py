"""Where a batch-1 step of the target alone spends its time: the lean pass, the output layer, and the glue around
them, with the read rate sustained around each round.

A step streams every weight, past every cache, so the Python and the small torch ops between the two products run
with cold caches. This probe times, over rounds of 64 one-token steps after a short prompt, the lean pass's call,
the output layer's call and the rest of each step (the glue: ids, the cache's bookkeeping, embedding, rotary
tables, picking the row, the argmax), and one small index op warm and right after a 512 MiB reduction. Run it
alone:

    python -m benchmarks.probes.step_glue --rounds 6 --out FILE.json
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import rounds_args, write_result

STEPS = 64
PROMPT = "Explain why the sky looks blue at noon and red at sunset."


def _timed(fn, into: dict, key: str):
    """fn wrapped so that each call's seconds add to into[key]."""
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] += time.perf_counter() - t0
    return wrapped


def cold_op_ms(probe: torch.Tensor, repeats: int = 30) -> dict:
    """A small index op's milliseconds warm and right after a reduction over `probe`: medians."""
    h = torch.randn(1, 1, 576)
    warm, cold = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        h[[0], [0]]
        warm.append(time.perf_counter() - t0)
        probe.sum()
        t0 = time.perf_counter()
        h[[0], [0]]
        cold.append(time.perf_counter() - t0)
    return {"warm_ms": round(statistics.median(warm) * 1e3, 4), "cold_ms": round(statistics.median(cold) * 1e3, 4)}


def main() -> None:
    args = rounds_args(__doc__, 6, f"{STEPS} one-token steps")
    from benchmarks.memory_floor import sustained_bandwidth
    from benchmarks.meta import result_meta
    from starjar.model import lean_pass
    from starjar.model.default_pair import TARGET_NAME, models_home
    from starjar.model.loading import load_model

    started = time.perf_counter()
    target = load_model(str(models_home() / TARGET_NAME))
    if target.lean_target is None or not lean_pass.available():
        args.error("the lean pass does not run for this target here: there is no pass to time around")
    spent = {"lean_pass": 0.0, "head": 0.0}
    lean_pass.run = _timed(lean_pass.run, spent, "lean_pass")
    head = target.model.get_output_embeddings()
    head.forward = _timed(head.forward, spent, "head")
    probe = torch.ones(512 << 18)
    prompt = target.tokenizer(PROMPT)["input_ids"]
    rounds = []
    with torch.inference_mode():
        for i in range(args.rounds + 1):  # the first round warms up
            cache = target.new_cache()
            slot = cache.allocate()
            tok = int(target.forward(cache, [slot], [prompt], [[len(prompt) - 1]])[0][-1].argmax())
            before = sustained_bandwidth(probe, 0.4)
            spent["lean_pass"] = spent["head"] = 0.0
            t0 = time.perf_counter()
            for _ in range(STEPS):
                tok = int(target.forward(cache, [slot], [[tok]], [[0]])[0][-1].argmax())
            wall = time.perf_counter() - t0
            if i == 0:
                continue
            per = {k: v / STEPS * 1e3 for k, v in spent.items()}
            rounds.append({"sustained_read_gb_per_s": round((before + sustained_bandwidth(probe, 0.4)) / 2e9, 2),
                           "step_ms": round(wall / STEPS * 1e3, 3), "lean_pass_ms": round(per["lean_pass"], 3),
                           "head_ms": round(per["head"], 3),
                           "glue_ms": round(wall / STEPS * 1e3 - per["lean_pass"] - per["head"], 3)})
            print(f"round {i}/{args.rounds}: " + ", ".join(f"{k} {v}" for k, v in rounds[-1].items()), flush=True)
    result = {"target": TARGET_NAME, "steps": STEPS,
              **{k: round(statistics.median(r[k] for r in rounds), 3)
                 for k in ("step_ms", "lean_pass_ms", "head_ms", "glue_ms")},
              "small_op": cold_op_ms(probe), "rounds": rounds,
              "meta": result_meta(benchmark="step_glue", wall_s=round(time.perf_counter() - started, 1))}
    write_result(args.out, result, f"a step {result['step_ms']} ms: lean pass {result['lean_pass_ms']}, output layer "
                 f"{result['head_ms']}, glue {result['glue_ms']}; a small op {result['small_op']['warm_ms']} ms warm, "
                 f"{result['small_op']['cold_ms']} ms after a 512 MiB reduction")


if __name__ == "__main__":
    main()
