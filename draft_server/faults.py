"""Fault switches for chaos tests, read from STARJAR_DRAFT_FAULTS and inert without it.

The value is a comma-separated list of switches, e.g. "delay_ms=200,crash_after=5":
  delay_ms=N      every reply waits N ms (a slow network or a slow server)
  slow_step_ms=N  every draft pass takes N ms longer
  catchup_ms_per_token=N
                  every token a round makes the draft compute (a prompt, a catch-up) costs N ms more: a draft slow
                  to prefill long prompts
  catchup_busy=1  that cost is spent computing (a loop that holds the CPU and the GIL), not asleep: a draft
                  that prefills on the target's own cores
  hang_after=N    after N rounds answered, the compute thread blocks for good (a hung server)
  spell_from=N, spell_rounds=M, spell_ms=T
                  rounds N..N+M-1 (counted from 0) each wait T ms before their reply: a slow spell, then well again
  crash_after=N   after N rounds answered, the process exits at once (exit code 86)
  corrupt=P       with probability P a reply is corrupted (more tokens than asked, outside the vocabulary)
  refuse=1        every Attach is refused UNAVAILABLE
Nothing reads these in production: an unset variable gives a plan where every switch is off.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass, fields

from starjar.errors import InvalidArgument

log = logging.getLogger(__name__)
ENV = "STARJAR_DRAFT_FAULTS"
CRASH_EXIT_CODE = 86


@dataclass
class FaultPlan:
    delay_ms: float = 0.0
    slow_step_ms: float = 0.0
    catchup_ms_per_token: float = 0.0
    catchup_busy: int = 0
    hang_after: int = -1
    spell_from: int = -1
    spell_rounds: int = 0
    spell_ms: float = 0.0
    crash_after: int = -1
    corrupt: float = 0.0
    refuse: int = 0

    @classmethod
    def from_env(cls) -> FaultPlan:
        text = os.environ.get(ENV, "").strip()
        plan = cls()
        if not text:
            return plan
        kinds = {f.name: f.type for f in fields(cls)}
        for item in text.split(","):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in kinds:
                raise InvalidArgument(ENV, f"switches are {sorted(kinds)}", name)
            setattr(plan, name, (float if kinds[name] == "float" else int)(value))
        log.warning("fault injection on: %s", plan)
        return plan

    @property
    def active(self) -> bool:
        return self != FaultPlan()


class Faults:
    """What the compute loop and the service consult; every call is free when the plan is empty."""

    def __init__(self, plan: FaultPlan | None = None):
        self.plan = plan if plan is not None else FaultPlan.from_env()
        self.active = self.plan.active
        self.replies = 0
        self._rng = random.Random(0)
        self._hung = threading.Event()

    def after_pass(self) -> None:
        if self.active and self.plan.slow_step_ms:
            time.sleep(self.plan.slow_step_ms / 1000)

    def after_start(self, catchup_tokens: int) -> None:
        if self.active and self.plan.catchup_ms_per_token:
            cost = self.plan.catchup_ms_per_token * catchup_tokens / 1000
            if not self.plan.catchup_busy:
                time.sleep(cost)
                return
            until = time.perf_counter() + cost
            while time.perf_counter() < until:
                sum(range(200))

    def before_reply(self, replies: list) -> list:
        """Called on the compute thread before each round's reply; may delay, hang, crash or corrupt."""
        if not self.active:
            return replies
        p = self.plan
        if p.crash_after >= 0 and self.replies >= p.crash_after:
            log.warning("fault injection: crashing after %d rounds", self.replies)
            os._exit(CRASH_EXIT_CODE)
        if p.hang_after >= 0 and self.replies >= p.hang_after:
            log.warning("fault injection: hanging after %d rounds", self.replies)
            self._hung.wait()  # until release() (server stop); a SIGSTOP without the signal
        if p.delay_ms:
            time.sleep(p.delay_ms / 1000)
        if 0 <= p.spell_from <= self.replies < p.spell_from + p.spell_rounds:
            time.sleep(p.spell_ms / 1000)
        self.replies += 1
        if p.corrupt and self._rng.random() < p.corrupt:
            return [[1 << 30, 0xFFFFFFFF] * 8 if r is not None else [7] for r in replies]
        return replies

    def refuse_attach(self) -> bool:
        return self.active and bool(self.plan.refuse)

    def release(self) -> None:
        self._hung.set()
