"""The int8 draft's agreement with the target measured two ways, per numerics variant: every position from
one teacher-forced pass, and from one-token steps after the prompt (as drafting runs). They differ where a
kernel's one-row numerics differ from its multi-row ones (fbgemm's AVX2 kernels with 8-bit activations).

    flock /tmp/starjar-cpu.lock python benchmarks/probes/measure_step_agreement.py
    flock /tmp/starjar-cpu.lock scripts/emulate_isa.sh avx2 python benchmarks/probes/measure_step_agreement.py
"""

from __future__ import annotations

import torch

VARIANTS = ({}, {"act_bits": 8}, {"smooth_alpha": 0.5}, {"act_bits": 8, "smooth_alpha": 0.5})


def main() -> None:
    from controller.colocated import colocated_engine
    from controller.tuning.pair_check import HEAD_VOCAB, OWN_PROMPTS
    from controller.tuning.scoring import agreement as _agreement
    from controller.tuning.scoring import explicit
    from starjar.cpu.kernels import machine_label
    from starjar.model.default_pair import build_default_pair
    from starjar.model.loading import load_model
    from starjar.model.text import encode_prompt
    from starjar.spec.sampling import SamplingParams

    torch.set_num_threads(2)
    pair = build_default_pair()
    target = load_model(pair["target"], what="target")
    prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in OWN_PROMPTS]
    engine = colocated_engine(target, None, 0, 1)
    outputs = [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=32))]
    print(machine_label())
    for extra in VARIANTS:
        variant = {"int8_kernel": "fused", "head_vocab": HEAD_VOCAB, **extra}
        draft = load_model(pair["draft"], what="draft", variant=explicit(variant))
        one_pass = _agreement(draft, prompts, outputs, stepwise=False)
        steps = _agreement(draft, prompts, outputs)
        print(f"{extra or 'base (7-bit)'}: one pass {one_pass:.3f}, one-token steps {steps:.3f}", flush=True)


if __name__ == "__main__":
    main()
