"""`starjar generate`: JSONL prompts in, JSONL results out, in input order."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from controller.cli.flags import check_output_path
from starjar.errors import InvalidArgument
from starjar.model.text import encode_prompt
from starjar.spec.policies import policy_help
from starjar.spec.sampling import SamplingParams
from starjar.wire.request import MAX_PROMPT_CHARS


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate for every prompt of a JSONL file")
    g.add_argument("--target", help="target model directory (default: the default pair's target)")
    g.add_argument("--draft", help="draft model directory (default: none; target alone)")
    g.add_argument("--draft-server", help="use a running draft server HOST:PORT instead of --draft")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    g.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    g.add_argument("--prompts", required=True, help='input JSONL, one {"prompt": "..."} per line')
    g.add_argument("--out", required=True, help="output JSONL, one result per input line, same order")
    g.add_argument("--gamma", type=int, default=4, help="draft tokens per step; 0 = target alone (default 4)")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    g.add_argument("--seed", type=int, default=None, help="base seed; prompt i uses seed + i")
    g.add_argument("--batch-size", type=int, default=16, help="cap on the running batch (default 16)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    g.add_argument("--policy", default="fixed", help=policy_help("fixed"))
    g.add_argument("--profile", default=None, help="latency tables from `starjar profile` (nightjar, tide)")


def read_prompts(path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument("--prompts", "must be an existing JSONL file", path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InvalidArgument("--prompts", f"must be UTF-8 text (byte {exc.start} is not)", path) from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:  # also a 4300-digit integer, or nesting past the parser
            raise InvalidArgument(f"--prompts line {n}", f"must be valid JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise InvalidArgument(f"--prompts line {n}", 'must be an object with a string "prompt"')
        if not obj["prompt"]:
            raise InvalidArgument(f"--prompts line {n}: prompt", "must not be empty")
        if len(obj["prompt"]) > MAX_PROMPT_CHARS:
            raise InvalidArgument(f"--prompts line {n}: prompt", f"at most {MAX_PROMPT_CHARS} characters")
        prompts.append(obj["prompt"])
    if not prompts:
        raise InvalidArgument("--prompts", "must contain at least one prompt", path)
    return prompts


def _engine(args):
    """The engine `generate` runs: a co-located draft (--draft), a remote one (--draft-server), or none."""
    from controller.colocated import colocated_engine, load_pair, remote_engine
    from starjar.model.default_pair import build_target
    from starjar.spec.policies import serving_policy

    target_dir = args.target or str(build_target())
    if args.draft and args.draft_server:
        raise InvalidArgument("--draft-server", "give either --draft or --draft-server, not both")
    draft_dir = args.draft if args.gamma > 0 else None
    target, draft = load_pair(target_dir, draft_dir, args.device, args.dtype)
    policy = serving_policy(args.policy, args.gamma, args.profile, bool(draft_dir or args.draft_server))
    if args.draft_server and args.gamma > 0:
        return target, remote_engine(target, args.draft_server, args.gamma, args.batch_size, policy=policy)
    return target, colocated_engine(target, draft, gamma=args.gamma, max_batch_size=args.batch_size, policy=policy)


def _encode_all(engine, tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    for i, p in enumerate(ids):
        try:
            engine.validate_prompt(p)
        except InvalidArgument as exc:
            raise InvalidArgument(f"--prompts line {i + 1}: {exc.field}", exc.limit, exc.value) from None
    return ids


class _Progress:
    """A progress bar with the output rate, fed each step's outputs."""

    def __init__(self, total: int):
        self.bar = tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
        self.t0 = time.perf_counter()
        self.tokens = 0

    def __call__(self, outs) -> None:
        self.tokens += sum(len(o.new_token_ids) for o in outs)
        done = sum(o.finished for o in outs)
        if done:
            self.bar.update(done)
        self.bar.set_postfix(tok_s=f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.1f}", refresh=False)


def _write_results(path: str, prompts: list[str], reqs, tokenizer) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for prompt, req in zip(prompts, reqs, strict=True):
            f.write(json.dumps({"prompt": prompt, "prompt_token_ids": req.prompt_ids, "token_ids": req.output_ids,
                                "text": tokenizer.decode(req.output_ids, skip_special_tokens=True),
                                "finish_reason": req.finish_reason}, ensure_ascii=False) + "\n")


def run_generate(args) -> int:
    if args.gamma < 0:
        raise InvalidArgument("--gamma", "must be >= 0", args.gamma)
    if args.batch_size < 1:
        raise InvalidArgument("--batch-size", "must be >= 1", args.batch_size)
    base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    SamplingParams(**base, seed=args.seed)  # fail on bad flags before loading anything
    check_output_path("--out", args.out)
    prompts = read_prompts(args.prompts)
    target, engine = _engine(args)
    ids = _encode_all(engine, target.tokenizer, prompts, args.chat)
    params = [SamplingParams(**base, seed=None if args.seed is None else args.seed + i) for i in range(len(ids))]
    progress = _Progress(len(ids))
    reqs = engine.generate(ids, params, on_step=progress)
    progress.bar.close()
    _write_results(args.out, prompts, reqs, target.tokenizer)
    if getattr(engine.proposer, "close", None):
        engine.proposer.close()
    s, tokens = engine.stats, progress.tokens
    wall = time.perf_counter() - progress.t0
    msg = f"{len(reqs)} requests, {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s)"
    if s.drafted_tokens:
        msg += f", acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_len:.2f}"
    print(msg + f" -> {args.out}", file=sys.stderr)
    return 0
