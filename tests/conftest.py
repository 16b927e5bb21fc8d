"""Shared fixtures: tiny random models made on the fly (session-scoped, nothing downloaded)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Helpers shared by test modules (servers, streams, clusters): imported by name from tests/helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The whole lean pass (starjar.model.lean_pass) sums in its own order, so the many tests that hold a pass to HF's
# bits run without it (a measured choice would make them depend on timing); tests/starjar/test_lean_pass.py
# turns it on and holds it to HF generate()'s greedy tokens.
os.environ.setdefault("STARJAR_LEAN_PASS", "0")
# Kernel choices are measured per machine and cached under STARJAR_HOME (kernels.json): a run over a folder of its
# own measures them as a fresh clone's first run does, instead of reading what earlier runs (or another build of
# the native kernels) chose in the user's home. Built native libraries stay shared (STARJAR_NATIVE_DIR).
if "STARJAR_HOME" not in os.environ:
    os.environ["STARJAR_HOME"] = _home = tempfile.mkdtemp(prefix="starjar-tests-")
    atexit.register(shutil.rmtree, _home, ignore_errors=True)
# Ray reads these when it is imported: tests join their own loopback clusters, each with its own Ray token
# (controller.cluster.spec.local_ray_env names the file).
for _k, _v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
               "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Directories of tiny models: a target per family, a draft sharing the llama tokenizer,
    and a draft with a different tokenizer."""
    from benchmarks.fixtures.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    dirs = {}
    dirs["llama"] = make_tiny_model(root / "llama", "llama", seed=0)
    dirs["qwen2"] = make_tiny_model(root / "qwen2", "qwen2", seed=1, tokenizer_from=dirs["llama"])
    dirs["gpt2"] = make_tiny_model(root / "gpt2", "gpt2", seed=2, tokenizer_from=dirs["llama"])
    # A draft that predicts the llama target imperfectly: same seed, one layer fewer.
    dirs["draft"] = make_tiny_model(root / "draft", "llama", seed=0, layers=1, tokenizer_from=dirs["llama"])
    dirs["other_tok"] = make_tiny_model(root / "other_tok", "llama", seed=3, tokenizer_vocab=320)
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(scope="session")
def models(model_dirs):
    from starjar.model.loading import load_model

    return {k: load_model(v) for k, v in model_dirs.items()}


@pytest.fixture(scope="session")
def prompt_ids(models):
    """Token ids of 40 of starjar's own prompts, round-robin over their categories (capped at 160 tokens)."""
    from starjar import workloads
    tok = models["llama"].tokenizer
    return [tok(p.text)["input_ids"][:160] for p in workloads.load("own", 40)]


@pytest.fixture(scope="session")
def reference(models, prompt_ids):
    """HF generate() greedy outputs per family: the ground truth for equality tests."""
    from benchmarks.fixtures.reference import hf_greedy

    cache = {}

    def get(family: str, max_new: int = 64) -> list[list[int]]:
        key = (family, max_new)
        if key not in cache:
            cache[key] = [hf_greedy(models[family], p, max_new) for p in prompt_ids]
        return cache[key]

    return get


@pytest.fixture(scope="session")
def long_prompts(models, prompt_ids):
    """Two prompts whose llama greedy continuation runs 300 tokens without EOS, and those continuations:
    generations long enough to be mid-stream when a signal lands (see streams.py)."""
    from benchmarks.fixtures.reference import hf_greedy

    prompts = prompt_ids[:2]
    refs = [hf_greedy(models["llama"], p, 300) for p in prompts]
    assert all(len(r) == 300 for r in refs), "a prompt whose reference ends early makes a short stream"
    return prompts, refs


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost and two client certificates, made on the fly: their
    paths by file name (see helpers/pki.py, which also holds the token and the client side)."""
    from pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
