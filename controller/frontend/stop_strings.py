"""Stop strings for the OpenAI endpoint: cut streamed text at the first stop string.

Text that could be the start of a stop string is held back until the next
piece shows whether it is one, so a stop string never leaks out half-sent.
As in OpenAI's API, the stop string itself is not part of the output.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        """The part of held + text that is safe to send now; sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):  # longest suffix of buf that starts s
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of the output: what was held back was not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.stopped else out
