"""A CPU fp32 model's few-row products take the path measured fastest on this machine (starjar.skinny_linear):
each path computes F.linear's product, the measurement picks the faster one and is cached per machine,
STARJAR_FP32_LINEAR forces one, and greedy output stays the target's own on either path."""

import json
import time
import types

import pytest
import torch
import torch.nn.functional as F

from controller.colocated import colocated_engine
from starjar import kernels, skinny_linear
from starjar.models import load_model
from starjar.reference import hf_greedy
from starjar.sampling import SamplingParams


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


@pytest.mark.parametrize("path", skinny_linear.PATHS)
def test_each_path_computes_f_linear_and_is_the_one_taken(path, monkeypatch):
    torch.manual_seed(0)
    body, head = torch.nn.Linear(48, 300, bias=True), torch.nn.Linear(48, skinny_linear.WIDE, bias=False)
    assert skinny_linear.install(torch.nn.Sequential(body, head), skinny_linear.RowPaths.every(path)) == 2
    calls = _matmul_calls(monkeypatch)
    for rows in (1, 2, 5, 33, 100):
        x = torch.randn(rows, 48)
        assert torch.allclose(body(x), F.linear(x, body.weight, body.bias), atol=1e-5)
        assert torch.allclose(head(x), F.linear(x, head.weight), atol=1e-4)
    assert len(calls) == (8 if path == "wxt" else 0)  # one row keeps F.linear's GEMV on both paths


def test_buckets_route_rows_and_the_output_layer_separately(monkeypatch):
    body, head = torch.nn.Linear(16, 32), torch.nn.Linear(16, skinny_linear.WIDE)
    paths = skinny_linear.RowPaths(["wxt", "linear", "linear", "linear", "linear", "wxt"],
                                   ["linear", "wxt", "wxt", "wxt", "wxt", "linear"])
    skinny_linear.install(torch.nn.Sequential(body, head), paths)
    calls = _matmul_calls(monkeypatch)
    for rows, layer, wxt in [(2, body, True), (3, body, False), (32, body, False), (33, body, True), (500, body, True),
                             (2, head, False), (3, head, True), (32, head, True), (33, head, False), (65, head, False)]:
        calls.clear()
        layer(torch.randn(rows, 16))
        assert bool(calls) == wxt, (rows, layer.out_features)


def _slowed(monkeypatch, slow_path: str) -> None:
    """Fault injection: make one path 3 ms slower per product, so the measurement must pick the other."""
    if slow_path == "wxt":
        real = torch.matmul

        def slow(*a, **k):
            time.sleep(0.003)
            return real(*a, **k)
        monkeypatch.setattr(skinny_linear.torch, "matmul", slow)
    else:
        def slow_linear(*a, **k):
            if a[0].numel() > a[0].shape[-1]:  # a multi-row product only, as the path applies to
                time.sleep(0.003)
            return F.linear(*a, **k)
        monkeypatch.setattr(skinny_linear, "F", types.SimpleNamespace(linear=slow_linear))


@pytest.mark.parametrize("slow_path", skinny_linear.PATHS)
def test_the_measurement_picks_the_faster_path_and_is_cached(fresh_cache, model_dirs, monkeypatch, slow_path):
    _slowed(monkeypatch, slow_path)
    m = load_model(model_dirs["llama"])
    other = next(p for p in skinny_linear.PATHS if p != slow_path)
    paths = skinny_linear.installed(m.model)
    assert paths.body == [other] * len(skinny_linear.BUCKETS)  # the tiny llama's head is narrow: body only
    entry = next(e for k, e in json.loads(fresh_cache.read_text()).items() if f"|{skinny_linear.KIND}|" in k)
    assert entry["paths"]["body"] == paths.body and len(entry["ms"]["body"]) == len(skinny_linear.BUCKETS)
    assert kernels.machine_info()["fp32_few_rows"]  # named in every benchmark's meta
    # Another process on this machine reads the cache instead of measuring again.
    monkeypatch.setattr(kernels, "_entries", {})
    monkeypatch.setattr(skinny_linear, "measure", lambda *a, **k: pytest.fail("measured twice"))
    assert skinny_linear.installed(load_model(model_dirs["llama"]).model).body == paths.body


@pytest.mark.parametrize("path", skinny_linear.PATHS)
def test_a_forced_path_is_not_measured(fresh_cache, model_dirs, monkeypatch, path):
    monkeypatch.setenv(skinny_linear.ENV, path)
    monkeypatch.setattr(skinny_linear, "measure", lambda *a, **k: pytest.fail("a forced path is not measured"))
    paths = skinny_linear.installed(load_model(model_dirs["llama"]).model)
    assert paths.body == paths.head == [path] * len(skinny_linear.BUCKETS)
    assert kernels.machine_info()["fp32_few_rows"] == {"forced": path}


def test_a_bad_forced_path_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv(skinny_linear.ENV, "gemv9000")
    with pytest.raises(ValueError, match="linear"):
        skinny_linear.forced()


@pytest.mark.parametrize("path", skinny_linear.PATHS)
def test_greedy_output_is_the_targets_own_on_each_path(model_dirs, models, spec_prompts, path):
    target = load_model(model_dirs["llama"])
    skinny_linear.installed(target.model).set(skinny_linear.RowPaths.every(path))
    prompts = spec_prompts[:12]
    alone = [hf_greedy(target, p, 32) for p in prompts]
    for gamma, batch in ((3, 1), (2, 4), (5, 8)):
        reqs = colocated_engine(target, models["draft"], gamma, batch).generate(prompts, SamplingParams(max_tokens=32))
        assert [r.output_ids for r in reqs] == alone, (gamma, batch)
