"""A CPU fp32 model's few-row products take the path measured fastest on this machine (starjar.cpu.skinny_linear):
each path computes F.linear's product, the measurement picks the fastest one and is cached per machine,
STARJAR_FP32_LINEAR forces one, and greedy output stays the target's own on every path."""

import copy
import json
import time
import types

import pytest
import torch
import torch.nn.functional as F

from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import colocated_engine
from starjar.cpu import few_rows, kernels, machine, skinny_linear
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    monkeypatch.delenv(skinny_linear.ENV, raising=False)
    monkeypatch.setattr(kernels, "_entries", {})
    return tmp_path / "kernels.json"


def _matmul_calls(monkeypatch) -> list:
    """Count W @ x.T products taken by the wxt path (F.linear does not go through torch.matmul)."""
    calls = []
    real = torch.matmul

    def counted(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)
    monkeypatch.setattr(skinny_linear.torch, "matmul", counted)
    return calls


def _packed_calls(monkeypatch) -> list:
    """Count products taken by the packed path (MKL's sgemm on packed weights)."""
    calls = []
    real = skinny_linear._packed_product

    def counted(layer, x):
        calls.append(x.shape)
        return real(layer, x)
    monkeypatch.setattr(skinny_linear, "_packed_product", counted)
    return calls


def _own_calls(monkeypatch) -> list:
    """Count products taken by starjar's own few-rows product."""
    calls = []
    real = few_rows.product

    def counted(x, w, b):
        calls.append(x.shape)
        return real(x, w, b)
    monkeypatch.setattr(skinny_linear.few_rows, "product", counted)
    return calls


needs_mkl = pytest.mark.skipif(not skinny_linear.packing_available(), reason="torch without MKL: no packed path")
needs_own = pytest.mark.skipif(not few_rows.available(), reason="starjar's few-rows product could not be built")
MARKS = {skinny_linear.PACKED: needs_mkl, skinny_linear.OWN: needs_own}
EVERY_PATH = [pytest.param(p, marks=MARKS[p]) if p in MARKS else p for p in skinny_linear.PATHS]


@pytest.mark.parametrize("path", EVERY_PATH)
def test_each_path_computes_f_linear_and_is_the_one_taken(path, monkeypatch):
    torch.manual_seed(0)
    body, head = torch.nn.Linear(48, 300, bias=True), torch.nn.Linear(48, skinny_linear.WIDE, bias=False)
    assert skinny_linear.install(torch.nn.Sequential(body, head), skinny_linear.RowPaths.every(path)) == 2
    calls, packed, own = _matmul_calls(monkeypatch), _packed_calls(monkeypatch), _own_calls(monkeypatch)
    with torch.no_grad():
        for rows in (1, 2, 5, 33, 100):
            x = torch.randn(rows, 48)
            assert torch.allclose(body(x), F.linear(x, body.weight, body.bias), atol=1e-5)
            assert torch.allclose(head(x), F.linear(x, head.weight), atol=1e-4)
    # one row keeps F.linear's GEMV on every path, but the output layer's on the own product where that is taken
    assert len(calls) == (8 if path == "wxt" else 0) and len(packed) == (8 if path == "packed" else 0)
    assert len(own) == (9 if path == "rows" else 0)


@needs_mkl
def test_packed_weights_follow_a_written_weight_and_autograd_falls_back():
    layer = torch.nn.Linear(32, 64, bias=False)
    skinny_linear.install(torch.nn.Sequential(layer), skinny_linear.RowPaths.every("packed"))
    x = torch.randn(5, 32)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2)  # an in-place write: the packed copy must not serve the old weight
        assert torch.allclose(layer(x), F.linear(x, layer.weight), atol=1e-5)
    twin = copy.deepcopy(layer)  # a packed weight has no storage to copy: the copy packs its own
    with torch.no_grad():
        twin.weight.add_(1)
        assert torch.allclose(twin(x), F.linear(x, twin.weight), atol=1e-5)
        assert torch.allclose(layer(x), F.linear(x, layer.weight), atol=1e-5)
    out = layer(x)  # with grad: MKL's packed op has no backward, so F.linear serves it
    out.sum().backward()
    assert layer.weight.grad is not None


def test_buckets_route_rows_and_the_output_layer_separately(monkeypatch):
    assert skinny_linear.BUCKETS == (2, 3, 4, 6, 8, 16, 32, 64)
    body, head = torch.nn.Linear(16, 32), torch.nn.Linear(16, skinny_linear.WIDE)
    paths = skinny_linear.RowPaths(["wxt", "linear", "linear", "linear", "linear", "linear", "linear", "wxt"],
                                   ["linear", "wxt", "wxt", "wxt", "wxt", "wxt", "wxt", "linear"])
    skinny_linear.install(torch.nn.Sequential(body, head), paths)
    calls = _matmul_calls(monkeypatch)
    for rows, layer, wxt in [(2, body, True), (3, body, False), (32, body, False), (33, body, True), (500, body, True),
                             (2, head, False), (3, head, True), (32, head, True), (33, head, False), (65, head, False)]:
        calls.clear()
        layer(torch.randn(rows, 16))
        assert bool(calls) == wxt, (rows, layer.out_features)


@needs_own
@pytest.mark.parametrize("slow", skinny_linear.ONE_ROW)
def test_one_row_through_the_output_layer_takes_the_faster_path(monkeypatch, slow):
    """The body keeps F.linear's GEMV for one row; the output layer takes it or the own product, whichever
    measured faster (the other slowed here), with F.linear's values either way."""
    body, head = torch.nn.Linear(64, 32), torch.nn.Linear(64, skinny_linear.WIDE)
    paths = skinny_linear.RowPaths()
    skinny_linear.install(torch.nn.Sequential(body, head), paths)
    own_calls = []
    real_own, real_linear = few_rows.product, F.linear

    def own(*a):
        own_calls.append(a[0].shape[0])
        time.sleep(0.003 if slow == skinny_linear.OWN else 0)
        return real_own(*a)

    def linear(*a):
        time.sleep(0.003 if slow == "linear" else 0)
        return real_linear(*a)
    monkeypatch.setattr(skinny_linear.few_rows, "product", own)
    monkeypatch.setattr(skinny_linear, "F", types.SimpleNamespace(linear=linear))
    x = torch.randn(1, 64)
    ms = skinny_linear._time_one_row(paths, lambda: head(x), 3)
    assert set(ms) == set(skinny_linear.ONE_ROW) and paths.head_one != slow
    assert skinny_linear.RowPaths.from_dict(paths.as_dict()).head_one == paths.head_one
    own_calls.clear()
    assert torch.allclose(head(x), real_linear(x, head.weight, head.bias), atol=1e-5)
    body(x)
    assert own_calls == ([1] if paths.head_one == skinny_linear.OWN else [])


def _slowed(monkeypatch, slow_path: str) -> None:
    """Fault injection: make one path 3 ms slower per product."""
    if slow_path == "wxt":
        real = torch.matmul

        def slow(*a, **k):
            time.sleep(0.003)
            return real(*a, **k)
        monkeypatch.setattr(skinny_linear.torch, "matmul", slow)
    elif slow_path == "packed":
        real_packed = skinny_linear._packed_product

        def slow_packed(*a, **k):
            time.sleep(0.003)
            return real_packed(*a, **k)
        monkeypatch.setattr(skinny_linear, "_packed_product", slow_packed)
    elif slow_path == "rows":
        real_own = few_rows.product

        def slow_own(*a, **k):
            time.sleep(0.003)
            return real_own(*a, **k)
        monkeypatch.setattr(skinny_linear.few_rows, "product", slow_own)
    else:
        def slow_linear(*a, **k):
            if a[0].numel() > a[0].shape[-1]:  # a multi-row product only, as the path applies to
                time.sleep(0.003)
            return F.linear(*a, **k)
        monkeypatch.setattr(skinny_linear, "F", types.SimpleNamespace(linear=slow_linear))


# The measurement is the same whatever path wins: by default the two that may be missing (own, packed, each
# with its skip mark), the plain two (linear, wxt) with the slow suites.
MEASURED = [pytest.param(p, marks=MARKS.get(p, pytest.mark.slow)) for p in skinny_linear.PATHS]


@pytest.mark.parametrize("fast_path", MEASURED)
def test_the_measurement_picks_the_faster_path_and_is_cached(fresh_cache, model_dirs, monkeypatch, fast_path):
    for slow_path in skinny_linear.PATHS:
        if slow_path != fast_path:
            _slowed(monkeypatch, slow_path)
    m = load_model(model_dirs["llama"])
    paths = skinny_linear.installed(m.model)
    assert paths.body == [fast_path] * len(skinny_linear.BUCKETS)  # the tiny llama's head is narrow: body only
    packed_now = [lin for lin in m.model.modules() if "_starjar_packed" in lin.__dict__]
    assert bool(packed_now) == (fast_path == "packed")  # packed at load when chosen, never otherwise
    entry = next(e for k, e in json.loads(fresh_cache.read_text()).items() if f"|{skinny_linear.KIND}|" in k)
    assert entry["paths"]["body"] == paths.body and len(entry["ms"]["body"]) == len(skinny_linear.BUCKETS)
    assert set(entry["ms"]["body"][0]) == set(skinny_linear.candidate_paths(m.model))
    assert machine.machine_info()["fp32_few_rows"]  # named in every benchmark's meta
    # Another process on this machine reads the cache instead of measuring again.
    monkeypatch.setattr(kernels, "_entries", {})
    monkeypatch.setattr(skinny_linear, "measure", lambda *a, **k: pytest.fail("measured twice"))
    assert skinny_linear.installed(load_model(model_dirs["llama"]).model).body == paths.body


@needs_mkl
def test_packing_is_not_timed_where_its_copy_does_not_fit(fresh_cache, model_dirs, monkeypatch):
    for slow in ("linear", "wxt", "rows"):
        _slowed(monkeypatch, slow)
    assert skinny_linear.installed(load_model(model_dirs["llama"]).model).body[0] == "packed"
    # Less memory now: the cached choice that packs is measured again without the packed path.
    monkeypatch.setattr(kernels, "_entries", {})
    monkeypatch.setattr(skinny_linear, "_packing_fits", lambda model: False)
    m = load_model(model_dirs["llama"])
    assert "packed" not in skinny_linear.installed(m.model).body
    assert not [lin for lin in m.model.modules() if "_starjar_packed" in lin.__dict__]


@pytest.mark.parametrize("path", EVERY_PATH)
def test_a_forced_path_is_not_measured(fresh_cache, model_dirs, monkeypatch, path):
    monkeypatch.setenv(skinny_linear.ENV, path)
    monkeypatch.setattr(skinny_linear, "measure", lambda *a, **k: pytest.fail("a forced path is not measured"))
    paths = skinny_linear.installed(load_model(model_dirs["llama"]).model)
    assert paths.body == paths.head == [path] * len(skinny_linear.BUCKETS)
    assert machine.machine_info()["fp32_few_rows"] == {"forced": path}


def test_a_bad_forced_path_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv(skinny_linear.ENV, "gemv9000")
    with pytest.raises(ValueError, match="linear"):
        skinny_linear.forced()


@pytest.mark.parametrize("path", EVERY_PATH)
def test_greedy_output_is_the_targets_own_on_each_path(model_dirs, models, prompt_ids, path):
    target = load_model(model_dirs["llama"])
    skinny_linear.installed(target.model).set(skinny_linear.RowPaths.every(path))
    prompts = prompt_ids[:12]
    alone = [hf_greedy(target, p, 32) for p in prompts]
    for gamma, batch in ((3, 1), (2, 4), (5, 8)):
        reqs = colocated_engine(target, models["draft"], gamma, batch).generate(prompts, SamplingParams(max_tokens=32))
        assert [r.output_ids for r in reqs] == alone, (gamma, batch)
