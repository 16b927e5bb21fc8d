"""A target worker's Prometheus metrics (`starjar_target_*`).

Latencies follow vLLM's conventions and buckets (TTFT, inter-token latency,
end-to-end); spec-decode counters have vLLM's meaning (drafts = sequence-rounds
that carried drafts, draft tokens, accepted tokens, accepted per position).
Per-request events are observed on the engine runner's thread after each step;
counts and gauges are read from the engine at scrape time.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from starjar.service.metrics import E2E_BUCKETS, FAST_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, batch_bucket, new_registry

P = "starjar_target_"
ENGINE_PHASES = ("prefill", "propose", "verify")  # starjar_target_engine_seconds{phase}; EngineStats.<phase>_s
# The remote proposer's fallback reasons, exported at 0 until they happen.
FALLBACK_REASONS = ("deadline", "detached", "draft_prefill", "malformed", "resync", "stream_broken")


class TargetMetrics:
    def __init__(self, engine, proposer, target_model: str, draft_model: str = ""):
        self.engine = engine
        self.proposer = proposer
        self.registry = r = new_registry("target_worker", target_model=target_model, draft_model=draft_model)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "arrival to first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "time between output tokens (a step's time "
                             "divided among the tokens it produced)", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "arrival to last token", buckets=E2E_BUCKETS,
                             registry=r)
        self.finished = Counter(P + "requests_finished", "requests finished, by reason (stop, length, abort)",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "output tokens produced", registry=r)
        self.steps_by_gamma = Counter(P + "spec_steps", "decode steps by batch-size bucket and gamma chosen",
                                      ["batch_bucket", "gamma"], registry=r)
        self.gamma = Gauge(P + "gamma", "gamma chosen at the last decode step of this batch-size bucket",
                           ["batch_bucket"], registry=r)
        self.round_s = Histogram(P + "draft_round_seconds", "draft round as the target sees it (send to reply)",
                                 buckets=FAST_BUCKETS, registry=r)
        self.round_part_s = Histogram(P + "draft_round_part_seconds", "draft round split: wire (network and "
                                      "serialization), queue (wait at the draft server), compute (drafting)",
                                      ["part"], buckets=FAST_BUCKETS, registry=r)
        self._last_token_s: dict[int, float] = {}
        r.register(_EngineCollector(engine, proposer))
        engine.step_listener = self.on_step
        if proposer is not None:
            proposer.on_round = self.on_round

    def on_step(self, batch_size: int, gamma: int) -> None:
        bucket = batch_bucket(batch_size)
        self.steps_by_gamma.labels(bucket, str(gamma)).inc()
        self.gamma.labels(bucket).set(gamma)

    def on_round(self, total_s: float, queue_s: float, compute_s: float) -> None:
        self.round_s.observe(total_s)
        self.round_part_s.labels("wire").observe(max(0.0, total_s - queue_s - compute_s))
        self.round_part_s.labels("queue").observe(queue_s)
        self.round_part_s.labels("compute").observe(compute_s)

    def on_outputs(self, outs) -> None:
        """After each engine step, on the runner's thread."""
        now = time.perf_counter()
        for out in outs:
            req, n = out.request, len(out.new_token_ids)
            key = id(req)
            last = self._last_token_s.get(key)
            if n:
                self.generation_tokens.inc(n)
                if last is None:
                    self.prompt_tokens.inc(len(req.prompt_ids))
                    self.ttft.observe((req.first_token_s or now) - req.arrival_s)
                    if n > 1:  # tokens beyond the first came in the same step
                        for _ in range(n - 1):
                            self.itl.observe(0.0)
                else:
                    for _ in range(n):
                        self.itl.observe((now - last) / n)
                self._last_token_s[key] = now
            if out.finished:
                self._last_token_s.pop(key, None)
                self.e2e.observe((req.finish_s or now) - req.arrival_s)
                self.finished.labels(req.finish_reason or "stop").inc()

    def on_abort(self, req) -> None:
        self._last_token_s.pop(id(req), None)
        self.finished.labels("abort").inc()


class _EngineCollector:
    def __init__(self, engine, proposer):
        self.engine = engine
        self.proposer = proposer

    def collect(self):
        e, s = self.engine, self.engine.stats
        running = list(e.scheduler.running)
        yield GaugeMetricFamily(P + "requests_running", "requests in the running batch", value=len(running))
        yield GaugeMetricFamily(P + "requests_waiting", "requests queued for a batch slot",
                                value=len(e.scheduler.waiting))
        yield GaugeMetricFamily(P + "kv_budget_tokens", "KV cache budget, in tokens",
                                value=e.scheduler.kv_budget_tokens)
        yield GaugeMetricFamily(P + "kv_used_tokens", "KV cache tokens held by running requests",
                                value=sum(r.num_tokens for r in running))
        yield GaugeMetricFamily(P + "kv_usage_ratio", "KV cache use, 0-1",
                                value=sum(r.num_tokens for r in running) / max(1, e.scheduler.kv_budget_tokens))
        yield CounterMetricFamily(P + "decode_steps", "decode steps (speculative or not)", value=s.decode_steps)
        yield CounterMetricFamily(P + "preemptions", "running requests preempted for KV space", value=s.preemptions)
        yield CounterMetricFamily(P + "spec_decode_num_drafts", "sequence-rounds that carried drafts",
                                  value=s.spec_rounds)
        yield CounterMetricFamily(P + "spec_decode_num_draft_tokens", "draft tokens verified",
                                  value=s.drafted_tokens)
        yield CounterMetricFamily(P + "spec_decode_num_accepted_tokens", "draft tokens accepted",
                                  value=s.accepted_tokens)
        yield CounterMetricFamily(P + "tree_rounds", "sequence-rounds that verified a token tree (--tree)",
                                  value=s.tree_rounds)
        yield CounterMetricFamily(P + "tree_nodes", "token-tree nodes verified", value=s.tree_nodes)
        # Where the engine thread's time goes (a deployment's cost shows here: a slower verify, longer drafts).
        phases = CounterMetricFamily(P + "engine_seconds", "engine time by phase: prefill (prompts), propose "
                                     "(asking for drafts: draft compute, wire and waits), verify (scoring "
                                     "passes, emitting their tokens)", labels=["phase"])
        for phase in ENGINE_PHASES:
            phases.add_metric([phase], getattr(s, phase + "_s"))
        yield phases
        if e.trees is not None:
            yield GaugeMetricFamily(P + "tree_verify_budget", "tokens per verification pass the tree selection "
                                    "may use (profiled)", value=e.trees.cfg.budget)
        per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                      "draft tokens accepted at each draft position (0 = first)",
                                      labels=["position"])
        last = max((i for i, n in enumerate(s.accepted_per_position) if n), default=0)
        for i in range(last + 1):
            per_pos.add_metric([str(i)], s.accepted_per_position[i])
        yield per_pos
        fallbacks = CounterMetricFamily(P + "draft_fallbacks", "steps a sequence ran without drafts because the "
                                        "draft service failed, by reason", labels=["reason"])
        if self.proposer is not None:
            seen = self.proposer.stats.fallbacks
            for reason in sorted(set(FALLBACK_REASONS) | set(seen)):
                fallbacks.add_metric([reason], seen.get(reason, 0))
        yield fallbacks
        attached = 1 if self.proposer is not None and getattr(self.proposer, "attached", False) else 0
        yield GaugeMetricFamily(P + "draft_attached", "1 while attached to the draft server", value=attached)
