"""On a CUDA device: the engine's greedy output equals HF generate() on the same device, draft and target on the
GPU, in float32 and bfloat16. Marked gpu (the default suite runs on CPU-only CI); run with `-m gpu`."""

import pytest
import torch

from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import colocated_engine, load_pair
from starjar.spec.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gamma,batch", [(0, 4), (3, 1), (3, 8), (5, 16)])
def test_greedy_on_cuda_equals_hf_generate_there(model_dirs, prompt_ids, dtype, gamma, batch):
    target, draft = load_pair(model_dirs["llama"], model_dirs["draft"], "cuda", dtype)
    assert target.device.type == "cuda" and draft.device.type == "cuda"
    prompts = prompt_ids[:16]
    ref = [hf_greedy(target, p, 48) for p in prompts]
    engine = colocated_engine(target, draft if gamma else None, gamma, batch)
    assert [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=48))] == ref
    if gamma:
        assert 0 < engine.stats.acceptance_rate < 1
