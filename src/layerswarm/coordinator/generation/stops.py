"""What a caller may see of a stream's text so far: detokenized incrementally, cut at stop sequences.

    push(id) -> (text delta, stopped)   the new text that is safe to show, and whether a stop sequence ended it
    flush()  -> text                    what was held back, once the stream ends another way

Text is held back while it could still become a stop sequence (its end is a prefix of one), and while it
ends in an incomplete UTF-8 character (byte-level tokens decode to U+FFFD until the rest arrives), so a
streamed answer never shows what the whole answer would not. The stop sequence itself is never shown
(OpenAI's rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # the text of every id so far (what was shown is text[:shown])
        self.shown = 0
        self.stopped_at: int | None = None  # where the stop sequence began, once one did

    def push(self, token_id: int) -> tuple[str, bool]:
        self.ids.append(token_id)
        self.text = self._decode(self.ids)
        cut = self._stop_index()
        if cut is not None:
            self.stopped_at = cut
            return self._show(cut), True
        return self._show(len(self.text) - self._held_back()), False

    def flush(self) -> str:
        """The held-back rest (the stream ended by eos or length, not by a stop sequence)."""
        end = self.stopped_at if self.stopped_at is not None else len(self.text)
        return self._show(end)

    @property
    def visible(self) -> str:
        """The whole answer as far as it can be shown."""
        return self.text[: self.shown]

    def _show(self, end: int) -> str:
        if end <= self.shown:
            return ""
        delta = self.text[self.shown : end]
        self.shown = end
        return delta

    def _stop_index(self) -> int | None:
        if not self.stops:
            return None
        # A stop can only begin in text not shown yet: whatever could have begun one was held back.
        found = [i for s in self.stops if (i := self.text.find(s, self.shown)) >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Characters at the end that may still turn into a stop sequence or a complete character."""
        text = self.text
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    held = max(held, k)
                    break
        return held
