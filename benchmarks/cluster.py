"""`starjar bench cluster`: real processes on loopback with the default pair.

One `starjar serve draft` and three `starjar serve target` processes; 50
requests per target through the SDK (4 concurrent per target), greedy. Every
output is compared with HF `generate()` on the target alone.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from benchmarks.common import pair_dirs, prompt_ids
from benchmarks.fixtures.reference import hf_greedy
from benchmarks.launch import ServerProcess
from starjar.client import Client
from starjar.model.loading import load_model


def run(args) -> dict:
    n_targets = 3
    n_requests, max_new = (10, 16) if args.quick else (50, 32)
    target_dir, draft_dir, note = pair_dirs(args)
    target = load_model(target_dir)
    prompts = prompt_ids(target.tokenizer, n_requests, args)
    ref = [hf_greedy(target, p, max_new) for p in tqdm(prompts, desc="HF generate (reference)", file=sys.stderr)]
    del target
    draft = ServerProcess("draft", "--model", draft_dir, "--port", "0")
    targets = [ServerProcess("target", "--model", target_dir, "--draft-server", draft.address, "--port", "0",
                             "--gamma", "1", "--batch-size", "4", "--worker-id", f"target-{k}")
               for k in range(n_targets)]
    results: dict[int, list] = {}
    failures: list[str] = []
    bar = tqdm(total=n_targets * n_requests, desc="requests", file=sys.stderr)

    def drive(k: int) -> None:
        def one(p):
            try:
                r = c.generate(prompt_token_ids=p, max_tokens=max_new)
                bar.update()
                return r.token_ids
            except Exception as exc:
                failures.append(repr(exc))
                return None

        with Client(targets[k].address, timeout=1800) as c, ThreadPoolExecutor(4) as pool:
            results[k] = list(pool.map(one, prompts))

    t0 = time.perf_counter()
    try:
        threads = [threading.Thread(target=drive, args=(k,)) for k in range(n_targets)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        for p in targets + [draft]:
            p.kill()
    bar.close()
    wall = time.perf_counter() - t0
    identical = sum(out == r for k in results for out, r in zip(results[k], ref, strict=True))
    tokens = sum(len(o) for k in results for o in results[k] if o)
    return {"pair": {"target": target_dir, "draft": draft_dir, "note": note},
            "processes": {"draft_servers": 1, "target_workers": n_targets},
            "requests": n_targets * n_requests, "max_new_tokens": max_new, "failed": len(failures),
            "identical_to_target_alone": identical, "tokens": tokens, "wall_s": round(wall, 1),
            "errors": failures[:5]}
