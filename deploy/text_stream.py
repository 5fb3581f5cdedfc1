"""Incremental detokenisation for streaming: text deltas that never have to be taken back.

Each delta is a slice of the decoded text of all tokens so far. Text that could still turn
into a stop string is held back (at most the longest stop string minus one character), as
is a trailing incomplete UTF-8 character; the final text ends before the first stop string.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.token_ids: list[int] = []
        self._sent = 0
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append committed tokens; the text that can be sent now."""
        self.token_ids.extend(token_ids)
        text = self.text
        upto = len(text) if final else len(text) - self._hold
        while not final and upto > self._sent and text[upto - 1] == "\ufffd":
            upto -= 1
        if upto <= self._sent:
            return ""
        delta, self._sent = text[self._sent: upto], upto
        return delta
