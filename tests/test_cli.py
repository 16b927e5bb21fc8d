"""`starjar generate` as a user runs it: a real subprocess, JSONL in, JSONL out."""

import json
import subprocess
import sys

from starjar.reference import hf_greedy
from starjar.workloads import spec_bench_prompts


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_jsonl_in_order_and_exact(tmp_path, model_dirs, models):
    prompts = spec_bench_prompts(7)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--gamma", "3",
                   "--max-tokens", "24", "--batch-size", "3", "--prompts", str(src), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "acceptance" in proc.stderr and "7 requests" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    tok = models["llama"].tokenizer
    for r in rows:
        assert set(r) == {"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}
        assert r["prompt_token_ids"] == tok(r["prompt"])["input_ids"]
        assert r["token_ids"] == hf_greedy(models["llama"], r["prompt_token_ids"], 24)
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True)
        assert r["finish_reason"] in ("stop", "length")


def test_generate_chat_and_sampling(tmp_path, model_dirs, models):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Tell me a joke"}\n{"prompt": "Why is the sky blue?"}\n')
    outs = []
    for i in range(2):
        out = tmp_path / f"out{i}.jsonl"
        proc = run_cli("generate", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--chat",
                       "--temperature", "0.8", "--top-k", "50", "--seed", "3", "--max-tokens", "12",
                       "--prompts", str(src), "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        outs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert outs[0] == outs[1]  # seeded: the same again
    chat_ids = models["llama"].tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a joke"}], add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    assert outs[0][0]["prompt_token_ids"] == list(chat_ids)


def test_gamma_zero_is_target_alone(tmp_path, model_dirs, models):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Count to ten"}\n')
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", "--target", model_dirs["llama"], "--draft", model_dirs["other_tok"], "--gamma", "0",
                   "--prompts", str(src), "--out", str(out))
    assert proc.returncode == 0, proc.stderr  # the draft is not even loaded
    row = json.loads(out.read_text())
    assert row["token_ids"] == hf_greedy(models["llama"], row["prompt_token_ids"], 64)
