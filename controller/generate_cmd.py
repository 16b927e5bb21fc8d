"""`starjar generate`: JSONL prompts in, JSONL results out, in input order."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from starjar.errors import InvalidArgument
from starjar.sampling import SamplingParams
from starjar.text import encode_prompt
from starjar.wire import MAX_PROMPT_CHARS


def read_prompts(path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument("--prompts", "must be an existing JSONL file", path)
    prompts = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"--prompts line {n}", f"must be valid JSON ({exc.msg})") from None
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


def run_generate(args) -> int:
    from controller.colocated import colocated_engine, load_pair, remote_engine
    from starjar.default_pair import build_target

    if args.gamma < 0:
        raise InvalidArgument("--gamma", "must be >= 0", args.gamma)
    if args.batch_size < 1:
        raise InvalidArgument("--batch-size", "must be >= 1", args.batch_size)
    base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    SamplingParams(**base, seed=args.seed)  # fail on bad flags before loading anything
    prompts = read_prompts(args.prompts)
    target_dir = args.target or str(build_target())
    if args.draft and args.draft_server:
        raise InvalidArgument("--draft-server", "give either --draft or --draft-server, not both")
    draft_dir = args.draft if args.gamma > 0 else None
    target, draft = load_pair(target_dir, draft_dir, args.device, args.dtype)
    from starjar.policies import serving_policy

    policy = serving_policy(args.policy, args.gamma, args.profile, bool(draft_dir or args.draft_server))
    if args.draft_server and args.gamma > 0:
        engine = remote_engine(target, args.draft_server, args.gamma, args.batch_size)
        engine.policy = policy
    else:
        engine = colocated_engine(target, draft, gamma=args.gamma, max_batch_size=args.batch_size, policy=policy)
    ids = [encode_prompt(target.tokenizer, p, args.chat) for p in prompts]
    for i, p in enumerate(ids):
        try:
            engine.validate_prompt(p)
        except InvalidArgument as exc:
            raise InvalidArgument(f"--prompts line {i + 1}: {exc.field}", exc.limit, exc.value) from None
    params = [SamplingParams(**base, seed=None if args.seed is None else args.seed + i) for i in range(len(ids))]
    bar = tqdm(total=len(ids), desc="generate", unit="req", file=sys.stderr)
    t0 = time.perf_counter()
    tokens = 0

    def on_step(outs):
        nonlocal tokens
        tokens += sum(len(o.new_token_ids) for o in outs)
        done = sum(o.finished for o in outs)
        if done:
            bar.update(done)
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f}", refresh=False)

    reqs = engine.generate(ids, params, on_step=on_step)
    bar.close()
    with open(args.out, "w", encoding="utf-8") as f:
        for prompt, req in zip(prompts, reqs):
            f.write(json.dumps({"prompt": prompt, "prompt_token_ids": req.prompt_ids, "token_ids": req.output_ids,
                                "text": target.tokenizer.decode(req.output_ids, skip_special_tokens=True),
                                "finish_reason": req.finish_reason}, ensure_ascii=False) + "\n")
    if getattr(engine.proposer, "close", None):
        engine.proposer.close()
    s = engine.stats
    wall = time.perf_counter() - t0
    msg = f"{len(reqs)} requests, {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s)"
    if s.drafted_tokens:
        msg += f", acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_len:.2f}"
    print(msg + f" -> {args.out}", file=sys.stderr)
    return 0
