"""The draft server's Prometheus metrics (`starjar_draft_*`).

Event timings (step, S(d), T_wait, T_idle, batch size) are histograms observed
by the compute loop as they happen; everything else is read from the server's
own bookkeeping at scrape time, so the exported numbers are the very ones
GetStats reports. Busy and idle time are exported as counters: load over any
window is rate(busy_time) / (rate(busy_time) + rate(idle_time)).

With online adaptation on (`--adapt`), `starjar_draft_tide_*` follow it. Its
training runs inside idle time, so the share of time spent training over a
window is rate(starjar_draft_tide_train_time_seconds_total[5m]) (seconds per
second), and the share of the idle time it used is that over
rate(starjar_draft_idle_time_seconds_total[5m]).
"""

from __future__ import annotations

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from starjar.service.metrics import BATCH_BUCKETS, FAST_BUCKETS, new_registry
from starjar.wire.keys import ADMISSION, CALLER, DRAINING, FINGERPRINT, WORKER_ID

P = "starjar_draft_"
# Exported at 0 until they happen.
REFUSAL_REASONS = (ADMISSION, CALLER, WORKER_ID, FINGERPRINT, DRAINING, "invalid")


class DraftMetrics:
    def __init__(self, server, draft_model: str):
        self.server = server
        self.registry = new_registry("draft_server", draft_model=draft_model)
        r = self.registry

        def hist(name: str, doc: str, buckets=FAST_BUCKETS) -> Histogram:
            return Histogram(P + name, doc, buckets=buckets, registry=r)

        self.step_s = hist("step_seconds", "one draft forward pass (t_s)")
        self.service_s = hist("service_seconds", "service time of a round, from its first pass to its reply (S)")
        self.wait_s = hist("queue_wait_seconds", "time a round waits before its first pass (T_wait)")
        self.idle_s = hist("idle_gap_seconds", "idle gap of the compute loop between batches (T_idle)")
        self.batch_rounds = hist("batch_rounds", "rounds (targets) in flight in one compute-loop iteration",
                                 BATCH_BUCKETS)
        self.batch_sequences = hist("batch_sequences", "sequences drafted by one compute-loop iteration", BATCH_BUCKETS)
        self.reload_s = hist("reload_seconds", "time to bring offloaded draft weights back")
        r.register(_StateCollector(server))

    # Called by the compute loop (its thread) -------------------------------------------------------

    def observe_pass(self, rounds: int, sequences: int, passes: int, pass_s: float) -> None:
        self.batch_rounds.observe(rounds)
        self.batch_sequences.observe(sequences)
        if passes:
            mean = pass_s / passes
            for _ in range(passes):
                self.step_s.observe(mean)

    def observe_round(self, wait_s: float, service_s: float) -> None:
        self.service_s.observe(service_s)
        self.wait_s.observe(wait_s)

    def observe_idle(self, gap_s: float) -> None:
        self.idle_s.observe(gap_s)


class _StateCollector:
    """Gauges and counters read from the server at scrape time."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        s = self.server
        snap = s.stats.snapshot()
        sessions = s.sessions.sessions()
        yield _gauge("attached_targets", "targets attached now", len(sessions))
        yield _gauge("max_targets", "N_max: targets admitted at once", s.sessions.max_targets)
        yield _gauge("live_sequences", "sequences with draft KV now", sum(len(x.seq_last_used) for x in sessions))
        yield _gauge("queue_depth", "rounds waiting for the compute loop", len(s.queue))
        yield _gauge("load_ratio", "busy fraction since the first round (GetStats' load)", snap["load"])
        yield _gauge("offloaded", "1 while the draft weights are offloaded to host memory and its KV dropped",
                     1 if s.compute.engine.offloaded else 0)
        yield _counter("offloads", "times the draft was offloaded", s.compute.engine.offloads)
        yield _counter("rounds", "rounds served", snap["rounds"])
        yield _counter("batches", "compute-loop iterations that drafted (one pass per length group)", snap["batches"])
        yield _counter("drafted_tokens", "draft tokens proposed", snap["drafted_tokens"])
        yield _counter("prompt_kv_tokens", "prompt tokens taken with a target's KV instead of prefilled",
                       s.compute.engine.stats.seeded_tokens)
        yield _counter("busy_time_seconds",
                       "compute-loop time not waiting on an empty queue (drafting, replies, bookkeeping)",
                       s.stats.busy_s)
        yield _counter("idle_time_seconds", "compute-loop time spent waiting for rounds (after the first one)",
                       s.stats.idle_s)
        for name, doc in LOOKAHEAD_COUNTERS:
            yield _counter(name, doc, snap[name])
        yield _counter("reclaimed_sequences", "sequences freed because their lease expired",
                       snap["reclaimed_sequences"])
        refusals = CounterMetricFamily(P + "refusals", "Attach calls refused, by reason", labels=["reason"])
        for reason in sorted(set(REFUSAL_REASONS) | set(s.service.refusals)):
            refusals.add_metric([reason], s.service.refusals.get(reason, 0))
        yield refusals
        # R_p: rounds per attached target. Only attached targets are exported, so the label is bounded by N_max.
        attached = {x.worker_id for x in sessions}
        per_target = CounterMetricFamily(P + "target_rounds", "rounds served per attached target worker (R_p)",
                                         labels=["target"])
        for worker, (n, _) in sorted(snap["per_worker"].items()):
            if worker in attached:
                per_target.add_metric([worker], n)
        yield per_target
        if getattr(s, "tide", None) is not None:
            yield from _tide_metrics(s.tide.snapshot(), snap["uptime_s"])


def _tide_metrics(t: dict, uptime_s: float):
    """Online adaptation (draft_server.tide.adaptation): acceptance averages, the collection switch, training work."""
    yield _gauge("tide_acceptance_short_ratio", "draft acceptance (accepted / proposed), short-horizon EMA",
                 t["acceptance_short"])
    yield _gauge("tide_acceptance_long_ratio", "draft acceptance (accepted / proposed), long-horizon EMA",
                 t["acceptance_long"])
    yield _gauge("tide_collecting", "1 while verified sequences are collected for training", int(t["collecting"]))
    yield _gauge("tide_heldout_acceptance_ratio",
                 "held-out next-token agreement of the serving draft with the targets (last training cycle)",
                 t["heldout_acceptance"])
    yield _gauge("tide_buffered_sequences", "finished sequences in the training buffer (memory only)",
                 t["buffered_sequences"])
    yield _gauge("tide_buffered_tokens", "tokens of the finished sequences in the training buffer",
                 t["buffered_tokens"])
    yield _gauge("tide_train_time_share_ratio", "compute-loop time spent training since start, over uptime",
                 t["train_s"] / uptime_s if uptime_s > 0 else 0.0)
    yield _counter("tide_train_steps", "training micro-steps run in idle time", t["train_steps"])
    yield _counter("tide_cycles", "training cycles finished (trained, then scored on held-out sequences)",
                   t["cycles"])
    yield _counter("tide_swaps", "adapted drafts swapped into serving", t["swaps"])
    yield _counter("tide_train_time_seconds", "compute-loop time spent training (taken from idle time only)",
                   t["train_s"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, value=value)


# The lookahead counters (draft_server.lookahead), named as in the stats snapshot and GetStats.
LOOKAHEAD_COUNTERS = (
    ("lookahead_hits", "rounds whose verified tokens matched what lookahead drafted ahead for"),
    ("lookahead_misses", "rounds that ended a lookahead stage without a match"),
    ("lookahead_drafted_tokens", "tokens drafted ahead in idle time (bonus-token guesses included)"),
    ("lookahead_wasted_tokens", "tokens drafted ahead that no reply used"),
    ("lookahead_prefilled_tokens", "prompt tokens fed ahead of their sequence's first round"),
    ("lookahead_branch_hits", "lookahead hits on a fanout branch (a rejection and its correction foreseen)"),
)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, doc, value=value)
