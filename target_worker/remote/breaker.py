"""A circuit breaker for the draft server: after a few missed deadlines in a row, stop waiting on it and let
one round through now and then (a growing interval) until it answers again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Breaker:
    """Stops proposing to a draft server that misses `after` deadlines in a row, then lets one round through
    after `probe_s` (doubling to `max_probe_s` while probes keep failing). While open a step costs nothing:
    it runs without drafts at once instead of waiting out the deadline."""

    def __init__(self, after: int = 3, probe_s: float = 1.0, max_probe_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.after, self.probe_s, self.max_probe_s, self.clock = after, probe_s, max_probe_s, clock
        self.misses = 0  # in a row
        self.opened = 0  # times it opened
        self._delay = probe_s
        self._open_until: float | None = None

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether a round may be sent now (a probe, when open and its time has come)."""
        return self._open_until is None or self.clock() >= self._open_until

    def missed(self) -> None:
        self.misses += 1
        if self._open_until is not None:  # a failed probe: wait longer before the next
            self._delay = min(self.max_probe_s, self._delay * 2)
            self._open_until = self.clock() + self._delay
        elif self.misses >= self.after:
            self.opened += 1
            log.warning("draft server missed %d deadlines in a row: no drafts for %.1f s, then a probe",
                        self.misses, self._delay)
            self._open_until = self.clock() + self._delay

    def answered(self) -> None:
        if self._open_until is not None:
            log.info("draft server answered again: proposing")
        self.misses, self._delay, self._open_until = 0, self.probe_s, None
