"""The target alone at batch 1 with each thread walking one run of its weight rows, and two at once, in one process.

AVX-512's one-row float product streams each weight row alone (tiles.h's row512); with the twin bit for one row
set, a thread walks the two halves of its share side by side (twin512), each asked for a weight row ahead into
L2. A shared machine's read rate drifts between states within seconds, so the two ways alternate within each
round, the round's sustained read rate (reductions of 512 MiB for half a second, before and after) is stored
beside them, and the ratio is taken per round. Greedy outputs must be the same bits either way. Run it alone:

    python -m benchmarks.probes.twin_stream_speed --rounds 12 --out FILE.json
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import rounds_args, write_result

ROUND_SUM_S = 0.5  # seconds of reductions before and after each round
TOKENS = 64
PROMPT = "Describe how a bicycle's gears let a rider climb a steep hill without tiring quickly."


def main() -> None:
    args = rounds_args(__doc__, 12, "running both ways in turn")
    from benchmarks.memory_floor import decode_once, sustained_bandwidth, weight_bytes
    from benchmarks.meta import result_meta
    from controller.colocated import colocated_engine
    from starjar.cpu import few_rows
    from starjar.model.default_pair import TARGET_NAME, models_home
    from starjar.model.loading import load_model
    from starjar.spec.sampling import SamplingParams

    started = time.perf_counter()
    target = load_model(str(models_home() / TARGET_NAME))
    if not few_rows.available() or torch.ops.starjar.few_rows_isa() < few_rows.ISAS["avx512"]:
        args.error("this CPU runs no AVX-512 product: there is nothing to twin")
    settled = few_rows.stream_mask()
    one = settled & ~few_rows.TWINNED | 1  # one row streamed, one run a thread
    ways = {"one_run": one, "two_runs": one | 1 << few_rows.TWIN_SHIFT}
    prompt = target.tokenizer(PROMPT)["input_ids"]
    per_token = weight_bytes(target.model)
    probe = torch.ones(512 << 18)
    outputs: dict[str, list[int]] = {}
    for name, mask in ways.items():  # warm-up, and each way's greedy tokens
        few_rows.set_stream(mask)
        reqs = colocated_engine(target, None, 0, 1).generate([prompt], SamplingParams(max_tokens=TOKENS,
                                                                                      ignore_eos=True))
        outputs[name] = reqs[0].output_ids
    rounds = []
    try:
        for i in range(args.rounds):
            before = sustained_bandwidth(probe, ROUND_SUM_S)
            order = list(ways) if i % 2 == 0 else list(reversed(ways))
            rates = {}
            for name in order:
                few_rows.set_stream(ways[name])
                rates[name] = decode_once(target, prompt, TOKENS)
            sustained = (before + sustained_bandwidth(probe, ROUND_SUM_S)) / 2
            rounds.append({"sustained_read_gb_per_s": round(sustained / 1e9, 2),
                           **{f"{n}_tokens_per_s": round(r, 2) for n, r in rates.items()},
                           **{f"{n}_of_sustained": round(r * per_token / sustained, 3) for n, r in rates.items()}})
            print(f"round {i + 1}/{args.rounds}: read {sustained / 1e9:.1f} GB/s, "
                  + ", ".join(f"{n} {r:.1f} tokens/s" for n, r in rates.items()), flush=True)
    finally:
        few_rows.set_stream(settled)
    ratio = statistics.median(r["two_runs_tokens_per_s"] / r["one_run_tokens_per_s"] for r in rounds)
    result = {
        "target": TARGET_NAME, "tokens": TOKENS, "bytes_per_token": per_token,
        "two_runs_over_one": round(ratio, 3),
        **{f"{n}_tokens_per_s": round(statistics.median(r[f"{n}_tokens_per_s"] for r in rounds), 2) for n in ways},
        **{f"{n}_of_sustained": round(statistics.median(r[f"{n}_of_sustained"] for r in rounds), 3) for n in ways},
        "outputs_identical": outputs["one_run"] == outputs["two_runs"],
        "settled_mask": settled, "rounds": rounds,
        "meta": result_meta(benchmark="twin_stream_speed", wall_s=round(time.perf_counter() - started, 1)),
    }
    write_result(args.out, result, f"two runs over one: {ratio:.3f}x (median of {len(rounds)} rounds); "
                 f"of the sustained read rate: one {result['one_run_of_sustained']:.3f}, "
                 f"two {result['two_runs_of_sustained']:.3f}; outputs identical: {result['outputs_identical']}")


if __name__ == "__main__":
    main()
