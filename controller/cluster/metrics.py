"""The controller's metrics (`starjar_controller_*`) and Prometheus discovery.

The N_full estimate it exports is controller.fleet.admission's (estimate_n_full: from two GetStats
snapshots of a draft server a window apart, so it describes recent traffic).

Discovery: the controller writes a Prometheus file-SD JSON listing every live
metrics endpoint with a `component` label; deploy/prometheus/prometheus.yml
reads it. Written atomically (rename), so Prometheus never sees half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from starjar.service.metrics import new_registry

P = "starjar_controller_"


class ControllerMetrics:
    def __init__(self, controller, target_model: str, draft_model: str):
        self.controller = controller
        self.registry = new_registry("controller", target_model=target_model, draft_model=draft_model)
        self.registry.register(_Collector(controller))


class _Collector:
    def __init__(self, controller):
        self.c = controller

    def collect(self):
        c = self.c
        yield from per_draft_metrics(c.fleet, c.watch)
        policy = GaugeMetricFamily(P + "policy_info", "speculation policy the target workers run (value 1)",
                                   labels=["policy"])
        policy.add_metric([c.policy_name()], 1)
        yield policy
        restarts = CounterMetricFamily(P + "actor_restarts", "actor restarts seen, by actor", labels=["actor"])
        for name in c.actor_names():
            restarts.add_metric([name], c.restarts.get(name, 0))
        yield restarts
        live = GaugeMetricFamily(P + "actor_up", "1 while the actor answers", labels=["actor"])
        for name in c.actor_names():
            live.add_metric([name], 1 if c.live.get(name) else 0)
        yield live
        yield from fleet_metrics(c.fleet)


def per_draft_metrics(fleet, watch):
    """Per draft server: N_max, N_full, Z, S and its saturation guard (each decided for that server's targets)."""
    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(P + name, doc, labels=["draft"])

    n_max = gauge("n_max", "N_max: targets a draft server admits")
    n_full = gauge("n_full", "N_full = ceil(Z/S)+1 from a draft server's recent traffic")
    z = gauge("return_time_seconds", "Z: a target's time from drafts received to next round, per draft server")
    s = gauge("draft_service_seconds", "S: a draft server's service time per round, recent traffic")
    forced = gauge("saturation_forced", "1 while the controller forces gamma = 0 on a draft server's targets "
                   "because that server is saturated")
    holds = CounterMetricFamily(P + "saturation_holds", "times the controller turned speculation off for the "
                                "targets of a saturated draft server", labels=["draft"])
    for name, slot in sorted(fleet.slots.items()):
        w = watch.servers.get(name)
        n_max.add_metric([name], slot.n_max)
        if w is not None and w.estimate is not None:
            z.add_metric([name], w.estimate[0])
            s.add_metric([name], w.estimate[1])
            n_full.add_metric([name], w.estimate[2])
        forced.add_metric([name], 1 if watch.forcing(name) else 0)
        holds.add_metric([name], w.guard.times_forced if w is not None and w.guard is not None else 0)
    yield from (n_max, n_full, z, s, forced, holds)


def fleet_metrics(fleet):
    """Per draft server: measured load, attached targets, targets given to it; moves by reason; and the targets
    no draft server has room for (they decode without drafts)."""
    load = GaugeMetricFamily(P + "draft_load_ratio", "a draft server's busy fraction over the last window, "
                             "as the controller measured it for assignment", labels=["draft"])
    attached = GaugeMetricFamily(P + "draft_assigned_targets", "targets the controller assigned to a draft server",
                                 labels=["draft"])
    given = CounterMetricFamily(P + "draft_assignments", "targets given to a draft server (any reason)",
                                labels=["draft"])
    for name, slot in sorted(fleet.slots.items()):
        load.add_metric([name], slot.load)
        attached.add_metric([name], fleet.assignment.count(name))
        given.add_metric([name], fleet.assigned.get(name, 0))
    yield load
    yield attached
    yield given
    moves = CounterMetricFamily(P + "draft_reassignments", "targets moved between draft servers, by reason "
                                "(failover: its server died; rebalance; retire: its server was drained)",
                                labels=["reason"])
    for reason in ("failover", "rebalance", "retire"):
        moves.add_metric([reason], fleet.moves.get(reason, 0))
    yield moves
    yield GaugeMetricFamily(P + "targets_without_draft", "targets no live draft server has room for (they decode "
                            "without drafts)", value=len(fleet.assignment.unassigned()) if fleet.slots else 0)


SCRAPE_TOKEN_FILE = "metrics.token"  # beside the file-SD JSON; deploy/prometheus/prometheus.yml reads it


def write_scrape_token(sd_path: str, token: str | None) -> None:
    """The cluster token, for Prometheus to send (authorization.credentials_file), beside the file-SD JSON;
    readable by this user only. Without a token the endpoints are open and "none" is written."""
    _replace(Path(sd_path).with_name(SCRAPE_TOKEN_FILE), (token or "none") + "\n", mode=0o600)


def write_file_sd(path: str, endpoints: dict[str, str]) -> None:
    """endpoints: component name (draft_server, target_worker:NAME, front_end, controller) -> HOST:PORT. Readable
    by this user only, as the token beside it is (where every endpoint that takes the token listens), whatever
    the writing process's umask."""
    groups = []
    for name, address in sorted(endpoints.items()):
        component, _, instance = name.partition(":")
        labels = {"component": component}
        if instance:
            labels["worker"] = instance
        groups.append({"targets": [address], "labels": labels})
    _replace(Path(path), json.dumps(groups, indent=1), mode=0o600)


def _replace(target: Path, text: str, mode: int) -> None:
    """Write text to a temporary file (created with `mode`) and rename it over target, so a reader (Prometheus)
    never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        os.fchmod(f.fileno(), mode)  # exactly `mode`, whatever the umask or a leftover file's mode
        f.write(text)
    tmp.replace(target)
