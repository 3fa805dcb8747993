"""Stop strings in a streamed reply: OpenAI returns the text *before* the stop string, never the string itself.

The server stops generating once the decoded reply contains a stop string, but it has streamed the pieces that form
it by then. `StopText` holds back any tail that could still become a stop string, and at a match emits only what
precedes it; everything it lets through is final, so streaming and non-streaming replies are the same text.
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.emitted = ""
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that may be sent now (possibly "")."""
        if self.stopped:
            return ""
        if not self.stops:
            self.emitted += piece
            return piece
        self.pending += piece
        full = self.emitted + self.pending
        hits = [i for i in (full.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(full, min(hits))
        hold = max((n for s in self.stops for n in range(1, len(s)) if full.endswith(s[:n])), default=0)
        return self._release(full, len(full) - hold)

    def flush(self) -> str:
        """At the end of the reply: whatever was held back (a tail that never became a stop string)."""
        return "" if self.stopped else self._release(self.emitted + self.pending, len(self.emitted + self.pending))

    def _release(self, full: str, upto: int) -> str:
        """Emit `full[:upto]` (what is not out yet); the rest stays pending."""
        out = full[len(self.emitted):upto]
        self.emitted, self.pending = full[:upto], full[upto:]
        return out
