"""`starjar bench api`: the public API of a `starjar up` cluster on the default pair, end to end.

A local cluster (draft server, 2 target workers, front end) on loopback; 100
greedy requests from 8 concurrent SDK clients (4 blocking in threads, 4
asyncio), every output compared with HF `generate()` on the target alone; the
same prompts through the OpenAI endpoint (plain HTTP) compared with the SDK's
text; and how long a cancelled stream takes to free its target sequence and
its draft session.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.request

from tqdm import tqdm

from benchmarks.common import pair_dirs, prompt_ids
from benchmarks.fixtures.reference import hf_greedy
from starjar.model.loading import load_model


def mixed_clients(address: str, prompts: list[list[int]], max_tokens: int, on_done=None) -> list:
    """Greedy results of every prompt, from 8 concurrent callers: 4 threads with a blocking Client each and
    4 asyncio tasks with an AsyncClient each (prompt i goes to caller i % 8). on_done() after each one."""
    from starjar import AsyncClient, Client

    results = [None] * len(prompts)
    lanes = [list(range(k, len(prompts), 8)) for k in range(8)]

    def done(i, result):
        results[i] = result
        if on_done is not None:
            on_done()

    def sync_lane(idx):
        with Client(address, timeout=600) as c:
            for i in idx:
                done(i, c.generate(prompt_token_ids=prompts[i], max_tokens=max_tokens))

    async def async_lanes():
        async def lane(idx):
            async with AsyncClient(address, timeout=600) as c:
                for i in idx:
                    done(i, await c.generate(prompt_token_ids=prompts[i], max_tokens=max_tokens))
        await asyncio.gather(*(lane(idx) for idx in lanes[4:]))

    threads = [threading.Thread(target=sync_lane, args=(lanes[k],)) for k in range(4)]
    threads.append(threading.Thread(target=lambda: asyncio.run(async_lanes())))
    [t.start() for t in threads]
    [t.join() for t in threads]
    return results


def _live_counts(controller) -> tuple[int, int]:
    """(requests running or waiting on the target workers, sequences live on the draft server)."""
    import ray

    from controller.cluster.spec import NAMESPACE
    from controller.fleet.names import DRAFT

    targets = ray.get(controller.target_stats.remote())
    draft = ray.get(ray.get_actor(DRAFT, namespace=NAMESPACE).stats.remote())
    return sum(s["running"] + s["waiting"] for s in targets.values()), int(draft["live_sequences"])


def run(args) -> dict:
    from controller.cluster.spec import CONTROLLER, NAMESPACE, local_ray_env

    local_ray_env()
    import ray

    from controller.cluster.local import local_spec, read_state, start_local, stop_local
    from starjar import Client

    n_requests, max_new = (24, 16) if args.quick else (100, 32)
    target_dir, draft_dir, note = pair_dirs(args)
    target = load_model(target_dir)
    prompts = (prompt_ids(target.tokenizer, 50, args) * 2)[:n_requests]
    ref = [hf_greedy(target, p, max_new) for p in tqdm(prompts, desc="HF generate (reference)", file=sys.stderr)]
    del target
    if read_state() is not None:
        raise SystemExit("a local starjar cluster is running; `starjar down` first")
    addrs = start_local(local_spec(target_dir, draft_dir, targets=2, gamma=1, batch_size=4, grpc_port=0,
                                   http_port=0))
    state = read_state()
    try:
        ray.init(address=state["ray_address"], namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        bar = tqdm(total=len(prompts), desc="8 SDK clients", file=sys.stderr)
        t0 = time.perf_counter()
        results = mixed_clients(addrs["grpc"], prompts, max_new, bar.update)
        wall = time.perf_counter() - t0
        bar.close()
        identical = sum(r.token_ids == e for r, e in zip(results, ref, strict=True))
        drafted = sum(r.usage.draft_tokens for r in results)
        accepted = sum(r.usage.accepted_draft_tokens for r in results)

        # OpenAI endpoint vs SDK, same prompts as text (chat), greedy.
        http_same, http_n = 0, 8 if not args.quick else 3
        with Client(addrs["grpc"], timeout=600) as c:
            for k in range(http_n):
                text = f"Write one sentence about the number {k}."
                sdk = c.generate(text, chat=True, max_tokens=max_new).text
                body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_new,
                                   "temperature": 0}).encode()
                req = urllib.request.Request(addrs["http"] + "/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as resp:
                    http_same += json.loads(resp.read())["choices"][0]["message"]["content"] == sdk

            # Cancellation: start a long stream, read a few chunks, walk away; time until counts are back.
            stream = c.generate_stream(prompt_token_ids=prompts[0], max_tokens=400, ignore_eos=True)
            for _ in range(3):
                next(stream)
            busy = _live_counts(controller)
            t_cancel = time.perf_counter()
            stream.close()
            while _live_counts(controller) != (0, 0) and time.perf_counter() - t_cancel < 10:
                time.sleep(0.02)
            freed_s = time.perf_counter() - t_cancel
            freed = _live_counts(controller) == (0, 0)
    finally:
        ray.shutdown()
        stopped = stop_local()
    tokens = sum(len(r.token_ids) for r in results)
    return {"pair": {"target": target_dir, "draft": draft_dir, "note": note},
            "cluster": {"targets": 2, "gamma": 1, "batch_size": 4, "draft_mode": "batched"},
            "requests": len(prompts), "clients": "8 (4 blocking threads + 4 asyncio)", "max_tokens": max_new,
            "identical_to_hf_generate": identical, "output_tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "openai_http_same_text_as_sdk": f"{http_same}/{http_n}",
            "cancel": {"counts_while_streaming": busy, "freed": freed, "freed_after_s": round(freed_s, 3)},
            "down": {"processes_stopped": stopped[0] if stopped else 0,
                     "killed_after_timeout": stopped[1] if stopped else 0}}
