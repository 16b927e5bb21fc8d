"""The graphed decoder (starjar.model.cuda_graphs): HF's tokens from a pass of fixed shapes.

On the CPU the static pass runs eagerly where STARJAR_CUDA_GRAPHS=1 forces it; the `gpu` tests run the same
checks with the passes captured and replayed as CUDA graphs.
"""

import pytest
import torch

from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import colocated_engine
from starjar import workloads
from starjar.model import cuda_graphs
from starjar.model.cuda_graphs import ENV
from starjar.model.lean_target import ENV as LEAN_ENV
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams

CUDA = [pytest.param("cuda", marks=[pytest.mark.gpu,
                                    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture(scope="module")
def prompts(model_dirs) -> list[list[int]]:
    """Eight of starjar's own prompts as the tiny models' token ids (without loading every fixture model on the
    CPU, which a GPU run need not)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["llama"], local_files_only=True)
    return [tok(p.text)["input_ids"][:160] for p in workloads.load("own", 8)]


def _counted(model, monkeypatch) -> dict[str, int]:
    """Counts the passes that ran HF's decoder and the static one."""
    calls = {"hf": 0, "static": 0}
    base, static = model.model.base_model, model.graphs.decoder
    forward, run = base.forward, static.__call__

    def hf(*args, **kwargs):
        calls["hf"] += 1
        return forward(*args, **kwargs)

    def counted(*args, **kwargs):
        calls["static"] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(base, "forward", hf)
    monkeypatch.setattr(model.graphs, "decoder", counted)
    counted.base, counted.layers, counted.heads, counted.head_dim = static.base, static.layers, static.heads, \
        static.head_dim
    return calls


def _passes(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of the engines' pass shapes in a fresh cache: a ragged prefill (HF's: over 64 tokens), steps at
    batch 1, a verification over 4 positions, steps and ragged passes of several rows, a token tree, rows on
    scattered slots (HF's)."""
    cache = model.new_cache()
    slots = [cache.allocate() for _ in range(4)]
    out = model.forward(cache, slots, [p[:40] for p in prompts[:4]], [[39]] * 4)
    for tok in (5, 9, 14):
        out += model.forward(cache, slots[:1], [[tok]], [[0]])
    out += model.forward(cache, slots[1:2], [[3, 4, 5, 6]], [[0, 1, 2, 3]])
    out += model.forward(cache, slots, [[7]] * 4, [[0]] * 4)
    out += model.forward(cache, slots, [[8, 9, 10], [11], [12, 13], [14, 15, 16]], [[0, 1, 2], [0], [0, 1], [0, 1, 2]])
    out += model.forward(cache, slots[:1], [[12, 13, 14, 15]], [[0, 1, 2, 3]], trees=[(0, [-1, 0, 0, 1])])
    out += model.forward(cache, [slots[0], slots[2]], [[20], [21]], [[0], [0]])
    return out


def _load(model_dirs, family: str, device: str):
    return load_model(model_dirs[family], device=device)


@pytest.mark.parametrize("device", ["cpu", *CUDA])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_passes_give_hf_tokens(model_dirs, prompts, monkeypatch, device, family):
    """Every chain and tree pass over consecutive slots takes the static pass; its logits pick HF's tokens and
    differ from HF's by float rounding alone (the attention's sum runs over the padded key axis)."""
    monkeypatch.setenv(LEAN_ENV, "0")
    model = _load(model_dirs, family, device)
    calls = _counted(model, monkeypatch)
    monkeypatch.setenv(ENV, "0")
    hf = _passes(model, prompts)
    assert calls == {"hf": 9, "static": 0}
    monkeypatch.setenv(ENV, "1")
    static = _passes(model, prompts)
    # The prefill and the scattered rows stayed HF's; on CUDA a shape's first pass runs the static pass (one
    # call), its second is captured (two: a warm-up and the capture), later ones replay (none).
    g = model.graphs
    taken = calls["static"] if device == "cpu" else len(g.seen) + g.captures + g.replays
    assert calls["hf"] == 11 and taken == 7, (calls, taken)
    worst = max((a - b).abs().max().item() for a, b in zip(hf, static, strict=True))
    assert worst < 1e-4, worst
    for a, b in zip(hf, static, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("device", ["cpu", *CUDA])
@pytest.mark.parametrize("batch_size,gamma", [(1, 0), (4, 0), (1, 3), (4, 2)])
def test_engine_greedy_equals_hf_generate(model_dirs, prompts, monkeypatch, device, batch_size, gamma):
    monkeypatch.setenv(ENV, "1")
    target = _load(model_dirs, "llama", device)
    draft = _load(model_dirs, "draft", device) if gamma else None
    want = [hf_greedy(target, p, 48) for p in prompts]
    engine = colocated_engine(target, draft, gamma, batch_size)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=48))
    assert [r.output_ids for r in reqs] == want
    if device == "cuda":
        assert target.graphs.replays > target.graphs.captures > 0


def test_off_and_unforced_on_cpu_keep_hf_forward(models, monkeypatch):
    model = models["llama"]
    assert model.graphs is not None and models["gpt2"].graphs is None
    for value in ("0", ""):
        monkeypatch.setenv(ENV, value)
        assert not model.graphs.active()
    monkeypatch.setenv(ENV, "1")
    assert model.graphs.active()


def test_padded_mask_masks_the_capacity_past_the_pass():
    mask = torch.zeros(2, 1, 3, 5)
    full = cuda_graphs._padded(mask, 8)
    assert full.shape == (2, 1, 3, 8) and torch.equal(full[..., :5], mask)
    assert bool((full[..., 5:] == torch.finfo(torch.float32).min).all())
    assert cuda_graphs._padded(full, 8) is full


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_are_kept_per_shape_recaptured_when_the_cache_grows_and_bounded(model_dirs, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)  # CUDA models take the graphs unforced
    model = _load(model_dirs, "llama", "cuda")
    graphs = model.graphs
    cache = model.new_cache()
    slot = cache.allocate()
    model.forward(cache, [slot], [[1, 2, 3]], [[2]])  # a shape seen once is not captured
    for tok in range(4, 10):
        model.forward(cache, [slot], [[tok]], [[0]])
    assert graphs.captures == 1 and graphs.replays == 4  # the second step captured the step's shape
    cache.reserve(1024)  # the buffers move: the next steps run, then are captured, again
    for tok in (11, 12):
        model.forward(cache, [slot], [[tok]], [[0]])
    assert graphs.captures == 2
    graphs.max_graphs = 1
    for _ in range(2):
        model.forward(cache, [slot], [[12, 13]], [[1]])
    assert graphs.captures == 3 and len(graphs.graphs) == 1
