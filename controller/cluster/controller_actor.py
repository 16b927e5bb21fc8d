"""The controller: creates the cluster's actors, watches them, and publishes where they listen.

Every actor is detached, named in the `starjar` namespace and restartable, so
the cluster outlives the command that started it and comes back from crashes.
Twice a second the controller asks each actor where it is; a new pid means a
restart (counted), a new address is published: to the front end (target
list, pushed) and to target workers (the draft address, which they pull when
they reattach). A target that does not answer is taken out of routing until it
does. The controller itself is restartable: it finds its actors again by name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import ray

from controller.cluster.actors import DraftServerActor, FrontEndActor, TargetWorkerActor
from controller.cluster.spec import FRONTEND, NAMESPACE, ClusterSpec
from controller.fleet.fleet import DraftFleet
from controller.fleet.names import DRAFT, is_draft_name, target_name

log = logging.getLogger(__name__)
POLL_S = 0.5
INFO_TIMEOUT_S = 2.0
STATS_TIMEOUT_S = 4.0  # stats samples: a loaded machine answers slowly, and a sample is due only every 5 s


HEAD = {"node:__internal_head__": 0.001}  # the controller and front end live on the head node
STATS_EVERY = 10  # polls between draft-stats samples for N_full (5 s)
DRAIN_POLL_S = 0.1


def actor_options(name: str, resources: dict | None = None, gpus: float = 0) -> dict:
    # num_cpus=0: placement is by the starjar_* resources; threads are pinned by the actors themselves.
    return dict(name=name, namespace=NAMESPACE, lifetime="detached", max_restarts=-1, max_task_retries=-1,
                num_cpus=0, num_gpus=gpus, resources=resources or {}, get_if_exists=True)


class Controller:
    def __init__(self, spec: dict):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.spec = ClusterSpec.from_dict(spec)
        gpus = 1 if self.spec.device == "cuda" or (
            self.spec.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0) else 0
        self.targets = {target_name(i): ray.remote(TargetWorkerActor).options(
            **actor_options(target_name(i), {"starjar_target": 1}, gpus)).remote(self.spec.to_dict(), target_name(i))
            for i in range(self.spec.targets)}
        self.fleet = DraftFleet(lambda name: ray.remote(DraftServerActor).options(
            **actor_options(name, {"starjar_draft": 1}, gpus)).remote(self.spec.to_dict()),
            self.spec.max_targets, list(self.targets))
        for i in range(self.spec.draft_servers if self.spec.draft else 0):
            self.fleet.add(i)
        self.autoscaler = None
        if self.spec.autoscale_drafts and self.spec.draft:
            from controller.fleet.autoscale import Autoscaler, parse_range

            self.autoscaler = Autoscaler(*parse_range(self.spec.autoscale_drafts), stop=self._retire)
        self.frontend = ray.remote(FrontEndActor).options(**actor_options(FRONTEND, HEAD)).remote(self.spec.to_dict())
        self.info: dict[str, dict] = {}  # actor name -> its last answer to info()
        self.live: dict[str, bool] = {}
        self.restarts: Counter = Counter()
        self._pushed: tuple | None = None
        self._monitor: asyncio.Task | None = None
        self.started_s = time.time()
        self._polls = 0
        self.override: int | None = None  # a user's forced gamma (set_gamma)
        self._override_due: set[str] = set()  # targets that did not answer set_gamma: told again each sample
        from controller.fleet.saturation import SaturationGuard
        from controller.fleet.watch import FleetWatch

        guarded = self.spec.saturation_guard and self.spec.draft
        self.watch = FleetWatch(self.spec.max_targets, self.spec.admission == "auto",
                                SaturationGuard if guarded else None)
        self.metrics_address = None
        self._sd_written: dict | None = None
        if self.spec.metrics:
            from controller.cluster.metrics import ControllerMetrics
            from starjar.service.metrics import serve

            host = ray.util.get_node_ip_address()
            models = {"target_model": self.spec.target.rstrip("/").split("/")[-1],
                      "draft_model": (self.spec.draft or "").rstrip("/").split("/")[-1]}
            self._metrics = ControllerMetrics(self, **models)
            self.metrics_address = f"{host}:{serve(self._metrics.registry, host, token=self.spec.cluster_token)}"

    def policy_name(self) -> str:
        forced = self.watch.forced
        guard_off = self.override is None and bool(forced) and forced >= set(self.targets)  # every target held
        if not self.spec.draft or self.override == 0 or guard_off:
            return "none"
        if self.override is not None:
            return f"fixed_{self.override}"
        return f"fixed_{self.spec.gamma}" if self.spec.policy == "fixed" else self.spec.policy

    def actor_names(self) -> list[str]:
        return self._names()

    def _ensure_monitor(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self._refresh()
            except Exception:
                log.exception("refresh failed")
            await asyncio.sleep(POLL_S)

    async def _ask(self, name: str, handle) -> None:
        try:
            info = await asyncio.wait_for(handle.info.remote(), INFO_TIMEOUT_S)
        except Exception:  # restarting, or not started yet
            if self.live.get(name):
                log.warning("%s is not answering", name)
            self.live[name] = False
            return
        old = self.info.get(name)
        if old and old["pid"] != info["pid"]:
            self.restarts[name] += 1
            log.warning("%s restarted (pid %s -> %s), now at %s", name, old["pid"], info["pid"],
                        info.get("address") or info.get("grpc"))
        self.info[name], self.live[name] = info, True

    async def _refresh(self) -> None:
        actors = {**self.targets, FRONTEND: self.frontend, **self.fleet.handles}
        await asyncio.gather(*(self._ask(n, h) for n, h in actors.items()))
        self._polls += 1
        self.fleet.observe(self.info, self.live)
        await self.fleet.follow(self.fleet.settle(), self.targets)
        if self._polls % STATS_EVERY == 0:
            snaps = await self.fleet.sample_loads()
            await self._watch_fleet(snaps)
            if self.autoscaler is not None:
                await self.autoscaler.step(self.fleet)
        self._write_sd()
        routable = {n: self.info[n]["address"] for n in self.targets if self.live.get(n)}
        key = (tuple(sorted(routable.items())), self.info.get(FRONTEND, {}).get("pid"))
        if self.live.get(FRONTEND) and key != self._pushed:
            try:
                await asyncio.wait_for(self.frontend.set_targets.remote(routable), INFO_TIMEOUT_S)
                self._pushed = key
            except Exception as exc:
                log.warning("could not update the front end: %s", exc)

    async def _watch_fleet(self, snaps: dict[str, tuple[dict, dict]]) -> None:
        """Per draft server N_full, N_max and saturation verdicts (controller/fleet/watch.py), carried out."""
        w = self.watch
        if not snaps:
            return
        stats = None  # N_full is estimated from the draft servers alone; admission and the guard need the targets
        try:  # one sample of the targets serves every draft server's admission and guard
            stats = await self.target_stats() if w.active else None  # each target's answer bounded on its own
        except Exception as exc:
            log.info("target stats sample skipped: %r", exc)
        n_maxes = {n: s.n_max for n, s in self.fleet.slots.items()}
        plan = w.step(time.time(), snaps, stats, dict(self.fleet.assignment.of), n_maxes, self.override)
        for name, n in plan.n_max.items():
            try:
                await asyncio.wait_for(self.fleet.handles[name].set_max_targets.remote(n), INFO_TIMEOUT_S)
            except Exception as exc:
                log.warning("could not set N_max on %s: %s", name, exc)
                continue
            if n != n_maxes[name]:
                log.info("%s: N_max %d -> %d", name, n_maxes[name], n)
            self.fleet.slots[name].n_max = n
        await _each_within([self.targets[t].set_gamma.remote(g) for t, g in plan.gamma.items()], INFO_TIMEOUT_S)
        if self._override_due:  # a user's gamma some target was down for
            await self._tell_override(sorted(self._override_due & set(self.targets)))

    async def _retire(self, name: str, handle) -> None:
        self.watch.forgets(name)
        await _stop_actor(name, handle)

    def _write_sd(self) -> None:
        if not self.spec.prometheus_sd:
            return
        endpoints = {}
        for name, info in self.info.items():
            if self.live.get(name) and info.get("metrics"):
                kind = ("draft_server" if name == DRAFT else f"draft_server:{name}" if is_draft_name(name)
                        else "front_end" if name == FRONTEND else f"target_worker:{name}")
                endpoints[kind] = info["metrics"]
        if self.metrics_address:
            endpoints["controller"] = self.metrics_address
        if endpoints != self._sd_written:
            from controller.cluster.metrics import write_file_sd, write_scrape_token

            try:
                # The token first, every time: Prometheus scrapes what the SD file lists, and a token file put
                # back by hand (a checkout) is mended at the next change.
                write_scrape_token(self.spec.prometheus_sd, self.spec.cluster_token)
                write_file_sd(self.spec.prometheus_sd, endpoints)
                self._sd_written = endpoints
            except OSError as exc:
                log.warning("cannot write %s: %s", self.spec.prometheus_sd, exc)

    # ---- what others ask ------------------------------------------------------------------------

    async def draft_address(self, target: str | None = None, lost: str | None = None) -> str | None:
        """Where `target` should attach now (its assigned draft server; None: none has room, decode alone).
        `lost`: the address it just lost its stream to, checked at once (see DraftFleet.lost). Without a
        target name (older callers): the first live draft server."""
        self._ensure_monitor()
        if target is None or target not in self.targets:
            live = [n for n in self.fleet.handles if self.live.get(n)]
            return self.info[live[0]]["address"] if live else None
        if lost:
            await self.fleet.follow(await self.fleet.lost(target, lost, self.info, self.live), self.targets)
        return self.fleet.address_for(target, self.info)

    async def addresses(self) -> dict:
        self._ensure_monitor()
        fe = self.info.get(FRONTEND, {})
        metrics = [i["metrics"] for i in self.info.values() if i.get("metrics")]
        if self.metrics_address:
            metrics.append(self.metrics_address)
        return {"grpc": fe.get("grpc"), "http": fe.get("http"), "metrics": sorted(metrics)}

    async def status(self) -> dict:
        self._ensure_monitor()
        return {"actors": {n: {"live": self.live.get(n, False), **self.info.get(n, {})} for n in self._names()},
                "restarts": dict(self.restarts), "uptime_s": time.time() - self.started_s,
                "n_max": {n: s.n_max for n, s in self.fleet.slots.items()}, "policy": self.policy_name(),
                "drafts": self.fleet.view(), "autoscale": None if self.autoscaler is None else {
                    "min": self.autoscaler.lo, "max": self.autoscaler.hi, "added": self.autoscaler.added,
                    "retired": self.autoscaler.retired},
                "capacity": sum(s.n_max for s in self.fleet.slots.values() if s.live and not s.draining),
                "per_draft": self.watch.view(), "guard_forced": sorted(self.watch.forced)}

    def _names(self) -> list[str]:
        return list(self.fleet.handles) + list(self.targets) + [FRONTEND]

    async def wait_ready(self, timeout: float = 600.0) -> dict:
        """Until every actor answers, the targets are routable and (with a draft) attached to it."""
        self._ensure_monitor()
        deadline = time.time() + timeout
        while time.time() < deadline:
            ready = all(self.live.get(n) for n in self._names()) and self._pushed is not None
            if ready and self.fleet.handles:  # every target that has a draft server is attached to it
                with_one = [t for t, d in self.fleet.assignment.of.items() if d is not None]
                ready = bool(with_one) and all(self.info[n].get("draft_attached") for n in with_one)
            if ready:
                return await self.addresses()
            await asyncio.sleep(POLL_S)
        raise TimeoutError(f"cluster not ready after {timeout:.0f} s: {await self.status()}")

    async def target_stats(self) -> dict:
        """Every answering target's stats (one dead or restarting target must not blind the whole fleet's
        admission and saturation guard)."""
        stats = await _each_within([h.stats.remote() for h in self.targets.values()], STATS_TIMEOUT_S)
        return {t: s for t, s in zip(self.targets, stats, strict=True) if not isinstance(s, BaseException)}

    async def set_gamma(self, gamma: int | None) -> None:
        """Force every target's gamma (0 = speculation off); None = back to the configured policy."""
        self.override = gamma
        self.watch.cancel()
        await self._tell_override(list(self.targets))

    async def _tell_override(self, names: list[str]) -> None:
        """Tell targets the user's gamma, each call bounded: a restarting target would hold it for as long as
        it is down, so one that does not answer is told again at each sample until it does."""
        done = await _each_within([self.targets[t].set_gamma.remote(self.override) for t in names], INFO_TIMEOUT_S)
        late = {t for t, r in zip(names, done, strict=True) if isinstance(r, BaseException)}
        self._override_due = (self._override_due - set(names)) | late
        if late:
            log.warning("gamma %s not yet taken by %s (not answering)", self.override, ", ".join(sorted(late)))

    async def describe(self) -> dict:
        """The cluster's settings (the auth token left out)."""
        return {**self.spec.to_dict(), "auth_token": "***" if self.spec.auth_token else None,
                "cluster_token": "***" if self.spec.cluster_token else None}

    async def drain(self, timeout: float | None = None) -> dict:
        """Stop taking generations and let those in flight finish, for at most `timeout` seconds (default the
        spec's drain_timeout_s). Every target refuses new requests with UNAVAILABLE "draining", which the front
        end passes on (HTTP 503); the draft server keeps proposing meanwhile. Returns what was left and when."""
        timeout = self.spec.drain_timeout_s if timeout is None else timeout
        t0 = time.monotonic()
        await asyncio.gather(*(_bounded(h.begin_drain.remote()) for h in self.targets.values()))
        left = await self._in_flight()
        while left and time.monotonic() - t0 < timeout:
            await asyncio.sleep(DRAIN_POLL_S)
            left = await self._in_flight()
        took = time.monotonic() - t0
        if left:
            log.warning("drain: %d request(s) still in flight after %.0f s; they will be cut", left, took)
        else:
            log.info("drain: nothing in flight after %.1f s", took)
        return {"in_flight_left": left, "seconds": took}

    async def _in_flight(self) -> int:
        """Generations on the targets plus relays on the front end; an actor that does not answer counts 0."""
        asks = [_bounded(h.in_flight.remote()) for h in self.targets.values()]
        counts = await asyncio.gather(*asks, _bounded(self.frontend.in_flight.remote()))
        return sum(c for c in counts[:-1] if c) + sum((counts[-1] or {}).values())

    async def shutdown(self, drain: bool = True) -> dict | None:
        """Drain (unless told not to), stop each server, then kill every actor of the cluster: the front end
        and targets first, the draft server last (it serves the targets' rounds until they are done)."""
        drained = await self.drain() if drain else None
        if self._monitor:
            self._monitor.cancel()
        order = [FRONTEND, *self.targets, *self.fleet.handles]
        for name in order:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                continue
            await _bounded(handle.stop.remote())
            ray.kill(handle, no_restart=True)
        return drained


async def _stop_actor(name: str, handle) -> None:
    """A retired draft server: close its server (nothing is attached any more), then end the actor."""
    await _bounded(handle.stop.remote())
    ray.kill(handle, no_restart=True)


async def _bounded(ref, timeout: float = INFO_TIMEOUT_S * 5):
    """An actor call's result, or None when it fails or does not answer in time (dead, restarting)."""
    try:
        return await asyncio.wait_for(ref, timeout)
    except Exception as exc:  # noqa: BLE001 - shutting down: one unresponsive actor must not stop the rest
        log.info("shutdown: an actor call failed: %r", exc)
        return None


async def _each_within(calls: list, timeout: float) -> list:
    """Await Ray calls, each for at most `timeout` s: an answer, or the exception (a TimeoutError for one that
    does not answer). An actor being restarted, or waiting for a node, holds its calls instead of failing them
    (max_restarts=-1), and one such actor must not hold up the controller's loop."""
    return await asyncio.gather(*(asyncio.wait_for(c, timeout) for c in calls), return_exceptions=True)
