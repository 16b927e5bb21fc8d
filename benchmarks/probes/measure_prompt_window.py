"""Does a draft prompt window pay on this machine? The default pair co-located at batch 1, gamma 3, on the demo's
16 Spec-Bench prompts (chat template, 48 new tokens): the target alone, then the int8 draft reading whole prompts
and reading only their last 256/128/64 tokens (starjar.json key prompt_window, see starjar.model.loading.LoadedModel).
Prints wall time, acceptance and the draft's catch-up/step seconds per variant; outputs must be identical.
Run it alone, under the CPU lock:

    flock /tmp/starjar-cpu.lock python benchmarks/probes/measure_prompt_window.py
"""

from __future__ import annotations

import dataclasses
import time

from controller.colocated import colocated_engine, load_pair
from starjar import workloads
from starjar.cpu.kernels import machine_label
from starjar.model.default_pair import build_default_pair
from starjar.model.text import encode_prompt
from starjar.spec.sampling import SamplingParams

VARIANTS = [("target alone", None, 0), ("whole prompt", None, 3), ("last 256", 256, 3), ("last 128", 128, 3),
            ("last 64", 64, 3), ("whole prompt again", None, 3)]


def main() -> None:
    pair = build_default_pair()
    target, draft = load_pair(pair["target"], pair["draft"])
    prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in workloads.texts(workloads.load("own", 16))]
    print(machine_label(), "| prompt lengths", sorted(len(p) for p in prompts), flush=True)
    params = SamplingParams(max_tokens=48)
    colocated_engine(target, None, 0, 1).generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up
    ref = None
    for name, window, gamma in VARIANTS:
        d = dataclasses.replace(draft, prompt_window=window)
        eng = colocated_engine(target, d if gamma else None, gamma, 1)
        t0 = time.perf_counter()
        outs = [r.output_ids for r in eng.generate(prompts, params)]
        wall = time.perf_counter() - t0
        ref = ref or outs
        line = f"{name:19s} wall {wall:6.2f} s  identical {sum(a == b for a, b in zip(outs, ref, strict=True))}/16"
        if gamma:
            ds = eng.proposer.stats
            line += (f"  acceptance {eng.stats.acceptance_rate:.3f}  draft catch-up {ds.catchup_s:.2f} s "
                     f"({ds.catchup_tokens} tokens), steps {ds.step_s:.2f} s")
        print(line, flush=True)


if __name__ == "__main__":
    main()
