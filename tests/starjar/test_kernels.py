"""The int8 kernel is chosen by measurement on the running machine, cached, and forced by STARJAR_INT8_KERNEL;
folded grouped-query attention computes what Hugging Face's sdpa path does."""

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

from starjar.cpu import kernels, machine, quantized
from starjar.model.attention import folded_attention


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setattr(kernels, "_chosen", {})
    for name in kernels.ISA_LIMITS:  # the tests may run under scripts/emulate_isa.sh
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "kernels.json"


@pytest.mark.parametrize("fastest", kernels.INT8_PATHS)
def test_auto_takes_the_fastest_measured_path_and_caches_it(fresh_choice, monkeypatch, fastest):
    slow = {p: 10.0 for p in kernels.INT8_PATHS}
    def measure(shapes):
        return {**slow, fastest: 1.0}
    assert kernels.chosen_path(((64, 48),), measure) == fastest
    entry = next(iter(json.loads(fresh_choice.read_text()).values()))
    assert entry["path"] == fastest and entry["ms"][fastest] == 1.0
    assert kernels.cpu_model() in next(iter(json.loads(fresh_choice.read_text())))  # keyed by the CPU
    # A new process reads the cache instead of measuring again.
    monkeypatch.setattr(kernels, "_chosen", {})
    def measure(shapes):
        return pytest.fail("measured twice")
    assert kernels.chosen_path(((64, 48),), measure) == fastest


@pytest.mark.parametrize("path", kernels.INT8_PATHS)
def test_a_forced_path_wins_over_the_measurement(fresh_choice, monkeypatch, path):
    monkeypatch.setenv(kernels.ENV, path)
    def measure(shapes):
        return pytest.fail("a forced path is not measured")
    assert kernels.chosen_path(((64, 48),), measure) == path
    assert machine.machine_info()["int8_kernel"] == path


def test_a_bad_forced_path_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "avx9000")
    with pytest.raises(ValueError, match="int_mm"):
        kernels.forced_path()


def test_isa_limits_are_another_machine_for_the_choice(fresh_choice, monkeypatch):
    def measure(shapes):
        return {"int_mm": 1.0, "fused": 2.0}
    assert kernels.chosen_path(((64, 48),), measure) == "int_mm"
    assert machine.machine_info()["isa_limits"] == {}
    # Held to AVX2 (scripts/emulate_isa.sh), the machine measures again instead of reusing its own choice.
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setattr(kernels, "_chosen", {})
    def measure(shapes):
        return {"int_mm": 2.0, "fused": 1.0}
    assert kernels.chosen_path(((64, 48),), measure) == "fused"
    assert machine.machine_info()["isa_limits"] == {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
    assert "FBGEMM_ENABLE_INSTRUCTIONS=AVX2" in kernels.machine_label()
    # Without the limit again, the machine's own cached choice comes back unmeasured.
    monkeypatch.delenv("FBGEMM_ENABLE_INSTRUCTIONS")
    monkeypatch.setattr(kernels, "_chosen", {})
    def measure(shapes):
        return pytest.fail("measured twice")
    assert kernels.chosen_path(((64, 48),), measure) == "int_mm"
    assert len([k for k in json.loads(fresh_choice.read_text()) if k.endswith("|64x48")]) == 2


def test_int_mm_without_onednn_is_the_generic_kernel_with_the_same_result(monkeypatch):
    from starjar.cpu.quantized import RowInt8Linear, dynamic_int8

    torch.manual_seed(0)
    layer = RowInt8Linear(dynamic_int8(torch.nn.Linear(96, 40, bias=True)))
    x = torch.randn(6, 96)
    monkeypatch.delenv("STARJAR_INT_MM_ONEDNN", raising=False)
    onednn = layer.int_mm(x)
    monkeypatch.setenv("STARJAR_INT_MM_ONEDNN", "0")
    assert torch.equal(layer.int_mm(x), onednn)  # exact int32 sums either way
    # And no oneDNN primitive runs for it (oneDNN reads ONEDNN_VERBOSE when it starts: fresh processes).
    def s8_primitives(switch: str) -> list[str]:
        code = ("import torch; from starjar.cpu.quantized import RowInt8Linear, dynamic_int8; torch.manual_seed(0); "
                "RowInt8Linear(dynamic_int8(torch.nn.Linear(96, 40))).int_mm(torch.randn(6, 96)); print('done')")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "ONEDNN_VERBOSE": "1", "STARJAR_INT_MM_ONEDNN": switch})
        assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]
        return [ln for ln in (out.stdout + out.stderr).splitlines() if "primitive,exec" in ln and "s8" in ln]

    if not s8_primitives("1"):
        pytest.skip("torch._int_mm runs no oneDNN primitive on this machine: nothing for the switch to turn off")
    assert not s8_primitives("0")


def test_the_real_measurement_times_both_paths(fresh_choice):
    ms = quantized.time_paths(((32, 16),), rows=(2, 4), reps=1)
    assert set(ms) == set(kernels.INT8_PATHS) and all(v > 0 for v in ms.values())


def test_machine_info_names_the_cpu_and_its_capability():
    info = machine.machine_info()
    assert info["cpu_model"] and info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def _reference(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


class _Module:
    pass


@pytest.mark.parametrize("b,h,hkv,q,k", [(1, 4, 2, 1, 9), (3, 4, 2, 5, 17), (2, 9, 3, 4, 30), (2, 4, 4, 3, 8)])
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_folded_attention_is_grouped_query_attention(b, h, hkv, q, k, kind):
    torch.manual_seed(b * 100 + q)
    query, key, value = torch.randn(b, h, q, 16), torch.randn(b, hkv, k, 16), torch.randn(b, hkv, k, 16)
    starts = torch.randint(0, k - q + 1, (b,))  # ragged: each row's own context length
    pos = starts[:, None] + torch.arange(q)[None]
    allowed = (torch.arange(k)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, Q, K]
    mask = allowed if kind == "bool" else torch.zeros(b, 1, q, k).masked_fill(~allowed, torch.finfo().min)
    out, _ = folded_attention(_Module(), query, key, value, mask)
    assert out.shape == (b, q, h, 16)
    torch.testing.assert_close(out, _reference(query, key, value, mask), atol=1e-5, rtol=1e-5)
    again, _ = folded_attention(_Module(), query, key, value, mask)  # the folded mask is reused, not stale
    torch.testing.assert_close(again, out)


def test_folded_attention_without_a_mask_is_causal_on_a_prefill():
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 6, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    out, _ = folded_attention(_Module(), query, key, value, None)
    torch.testing.assert_close(out, _reference(query, key, value, causal), atol=1e-5, rtol=1e-5)


def test_a_folded_mask_lives_no_longer_than_its_pass_mask():
    """The per-pass folded mask (g x [B, Q, K]) must not stay in memory after its pass (it did until the next)."""
    from starjar.model import attention
    mask = torch.zeros(2, 1, 8, 64)
    folded = attention.fold_mask(mask, 2)
    assert attention.fold_mask(mask, 2) is folded  # reused by every layer of the pass
    ref = weakref.ref(folded)
    del mask, folded
    gc.collect()
    assert ref() is None and 2 not in attention._folded


@pytest.mark.parametrize("b,h,hkv,q,prefix", [(1, 9, 3, 1100, 0), (2, 4, 4, 700, 0), (1, 4, 2, 600, 300)])
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_a_long_pass_attends_in_key_blocks_with_the_same_bits(b, h, hkv, q, prefix, kind):
    """Past the flash kernel's key block, query rows go in chunks over the key blocks they may see: every bit as
    in one call over all keys, the chunks worked out once per pass mask."""
    from starjar.model import attention
    torch.manual_seed(q)
    k = prefix + q
    query, key, value = torch.randn(b, h, q, 64), torch.randn(b, hkv, k, 64), torch.randn(b, hkv, k, 64)
    pos = prefix + torch.arange(q)
    allowed = (torch.arange(k)[None, :] <= pos[:, None])[None, None].expand(b, 1, q, k)
    mask = allowed if kind == "bool" else torch.zeros(b, 1, q, k).masked_fill(~allowed, torch.finfo().min)
    chunks = attention.key_chunks(mask, k)
    assert chunks is not None and len(chunks) > 1 and chunks[0].keys < k
    assert attention.key_chunks(mask, k) is chunks  # once per pass
    out, _ = folded_attention(_Module(), query, key, value, mask)
    whole = attention._attend(query, key, value, mask, h // hkv, None).transpose(1, 2)
    assert torch.equal(out, whole), (out - whole).abs().max()
    torch.testing.assert_close(out, _reference(query, key, value, mask), atol=1e-5, rtol=1e-5)


def test_a_pass_within_one_key_block_attends_in_one_call():
    from starjar.model import attention
    mask = torch.zeros(1, 1, 400, 512)
    assert attention.key_chunks(mask, 512) is None and attention.key_chunks(torch.zeros(1, 1, 1, 900), 900) is None


def test_a_long_pass_in_another_dtype_attends_in_one_call(monkeypatch):
    """Chunks only where their bits are checked (float32): a bfloat16 pass attends all its keys at once."""
    from starjar.model import attention
    monkeypatch.setattr(attention, "key_chunks", lambda *a: pytest.fail("chunked a bfloat16 pass"))
    query, key = torch.randn(1, 2, 600, 16, dtype=torch.bfloat16), torch.randn(1, 2, 600, 16, dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, 600, 600, dtype=torch.bfloat16)
    out, _ = folded_attention(_Module(), query, key, key, mask)
    assert out.shape == (1, 600, 2, 16)


def test_a_pass_s_chunks_live_no_longer_than_its_mask():
    from starjar.model import attention
    mask = torch.zeros(1, 1, 700, 700).masked_fill(~torch.ones(700, 700, dtype=torch.bool).tril(), torch.finfo().min)
    query, key = torch.randn(1, 4, 700, 16), torch.randn(1, 2, 700, 16)
    folded_attention(_Module(), query, key, key, mask)
    chunks = attention.key_chunks(mask, 700)
    assert chunks is not None and all(2 in c.folded for c in chunks)  # folded once, for every layer
    ref = weakref.ref(mask)
    del mask, chunks
    gc.collect()
    assert ref() is None and "pass" not in attention._chunked


ADOPT_SCRIPT = """
import ctypes, glob, os, threading
import torch
from starjar.cpu.kernels import adopt_thread_count
libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))
if not libs:
    print("no-libgomp"); raise SystemExit
omp = ctypes.CDLL(libs[0])
torch.set_num_threads(2)
seen = {}
def work(adopt):
    if adopt:
        adopt_thread_count()
    seen[adopt] = omp.omp_get_max_threads()
for adopt in (False, True):
    t = threading.Thread(target=work, args=(adopt,)); t.start(); t.join()
print(seen[False], seen[True], torch.get_num_threads())
"""


def test_a_computing_thread_adopts_torchs_thread_count_over_the_environments():
    """Ray starts workers with OMP_NUM_THREADS=1: a thread started after torch.set_num_threads(2) still runs
    OpenMP regions on one thread (while torch.get_num_threads() says 2) until it adopts the count."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", ADOPT_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    if out == ["no-libgomp"]:
        pytest.skip("torch is not built with GNU OpenMP here")
    assert out == ["1", "2", "2"]


_HAND_OVER = """
import os, threading, torch
from starjar.cpu import kernels, machine, quantized
def tasks():
    return len(os.listdir("/proc/self/task"))
if kernels._omp_pause_resource_all() is None:
    print("no-libgomp")
    raise SystemExit(0)
torch.ones(1 << 22).sum()  # a parallel op: the main thread's OpenMP team starts
before = tasks()
released = kernels.hand_threads_to_compute()
after = tasks()
seen = {}
def compute():
    kernels.adopt_thread_count()
    seen["threads"] = torch.get_num_threads()
t = threading.Thread(target=compute)
t.start()
t.join()
torch.ones(1 << 22).sum()  # the main thread's later ops run on one thread: no team again
print(released, before - after, torch.get_num_threads(), seen["threads"], machine.machine_info()["threads"],
      tasks() - after)
"""


def test_the_loading_thread_hands_its_openmp_team_to_the_compute_threads():
    """A server's loading thread releases its idle OpenMP team (libgomp sleeps idle teams at once while it
    manages more threads than CPUs, which made every op of a compute thread's pass pay a wake-up) and keeps to
    one thread; compute threads adopt the count it had."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", _HAND_OVER], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-libgomp":
        pytest.skip("torch runs another OpenMP runtime here: nothing to release")
    released, gone, main_threads, compute_threads, reported, regrown = out.stdout.split()
    assert released == "True" and int(gone) == 1  # the team's one worker thread exited
    assert (main_threads, compute_threads, reported) == ("1", "2", "2")
    assert int(regrown) == 0


def test_other_native_kernels_measure_again(fresh_choice, monkeypatch, tmp_path):
    """A choice measured against starjar's kernels as they were is not reused once their sources change."""
    monkeypatch.setattr(kernels, "_entries", {})
    assert kernels.cached_entry("probe", ((8, 8),), lambda: {"x": 1})["x"] == 1
    assert kernels.cached_entry("probe", ((8, 8),), lambda: pytest.fail("measured twice"))["x"] == 1
    monkeypatch.setattr(kernels, "_entries", {})
    monkeypatch.setattr(kernels, "native_digest", lambda: "changed")
    assert kernels.cached_entry("probe", ((8, 8),), lambda: {"x": 2})["x"] == 2
    assert len(json.loads(fresh_choice.read_text())) == 2


def test_the_machine_key_names_the_native_kernels():
    digest = kernels.native_digest()
    assert len(digest) == 12 and digest == kernels.native_digest()
    assert kernels._machine_key().endswith(f"|native {digest}")
