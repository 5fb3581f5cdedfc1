"""Prompt lookup: draft the continuation of the longest recent n-gram match in a request's own tokens.

Where an answer repeats its prompt or itself (code edited in place, a quoted passage, a list that restates the
question), the tokens after an earlier occurrence of the last few tokens are a draft that costs no draft pass at
all. :class:`PromptLookup` keeps, per request, an index from every n-gram (``min_ngram`` to ``max_ngram`` tokens) to
the position after its earliest occurrence, updated as tokens are committed (O(new tokens x max_ngram) per step), and
proposes the continuation of the longest n-gram ending at the last token that occurred before. Earliest, as vLLM's
``ngram`` matches: on humaneval (20 prompts x 128 tokens, greedy, fp32) it kept tau 3.05 where the latest occurrence
kept 2.82 (a code answer restates its prompt more often than its own last lines).

A lookup draft is a one-point distribution: verified by the target's rejection sampler, its token is accepted with
the target's probability of that token (greedy: when it is the argmax), so the output stays exactly the target's.

:class:`LookupRecord` estimates, per request, how many of a lookup draft's tokens will be accepted: the survival at
each position (the share of its lookup drafts that kept at least j tokens), starting from a prior and moved by the
request's own verified drafts only (so a seeded sampled request's choices never depend on other traffic).
:class:`LookupStats` is the same estimate pooled over every request of the server, by the length of the n-gram
matched: what rows whose drafts may depend on other traffic (greedy rows, unseeded sampled rows) are scheduled by,
since one request verifies too few drafts to move a prior far, and a draft the scheduler trims never tests the
positions it cut (a pessimistic per-request prior keeps its drafts short for good).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The longest n-gram tried first, down to a single token where no longer one recurs (vLLM's `ngram` is configured
# here with prompt_lookup_min 2, _max 5). A one-token match is a weak guess, but on a CPU verifying a few more tokens
# at batch 1 costs little, and the choice weighs each match length by its own pooled record (the scheduler trims
# what does not pay): at batch 1, 20 prompts x 128 tokens, one process per system, the hybrid went from 0.98x to
# 1.03x vLLM's ngram greedy on humaneval, 0.96x to 1.02x at T=1, and from 0.96x to 0.99x greedy on mt-bench
MIN_NGRAM, MAX_NGRAM = 1, 5
# A seeded sampled row (pinned) goes by its own lookup record, one for every match length it drafted, from an
# optimistic prior: one-token guesses would each be verified nearly in full before its record learnt they seldom hold
# at T=1, and their misses would pull down its estimate of its long matches. It takes matches of 2 tokens or more
# (as vLLM's ngram): humaneval T=1 at batch 1 with one-token matches, 6.5 tokens verified per lookup draft for 0.8
# kept (docs/performance.md, issue 46's third run)
PINNED_MIN_NGRAM = 2
# The prior chance that lookup token j is accepted after every token before it was (j = 0, 1, ...; the last value
# for later positions): a continuation that has held for a few tokens tends to go on holding. vLLM's ngram on
# held-out code (greedy, SmolLM2-135M-Instruct) kept survival 0.72 0.55 0.44 0.43 0.36 0.36 0.35, conditionals
# 0.72 0.76 0.80 0.98 0.84 1.00 0.97. The prior is that shape, a little below it, and optimistic on purpose: a
# position the prefix scheduler cuts is never verified, so a pessimistic prior would never be corrected (with
# 0.6 at every position, humaneval's lookup drafts stayed at 2.8 tokens and tau 2.43 where vLLM's full drafts
# kept 3.56); an optimistic one is, by the drafts it lets through.
PRIOR_ACCEPT = (0.7, 0.75, 0.8, 0.85, 0.85, 0.85, 0.85)
PRIOR_WEIGHT = 2.0  # the prior counts as this many drafts


@dataclass
class LookupDraft:
    tokens: list[int]  # the continuation (empty: no match)
    match: int  # length of the n-gram matched (0: none)


class PromptLookup:
    """One request's token history and its n-gram index (each n-gram's earliest occurrence)."""

    def __init__(self, prompt: list[int], min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> position after its earliest occurrence
        self._indexed = 0  # n-grams ending before this position are in the index
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def _catch_up(self) -> None:
        """Index every n-gram that ends before the last token (the last token's n-grams are the query)."""
        toks, end = self.tokens, len(self.tokens) - 1
        for stop in range(max(self._indexed, 1), end + 1):  # n-grams toks[stop - n: stop], continuation at stop
            for n in range(self.min_ngram, min(self.max_ngram, stop) + 1):
                self._index.setdefault(tuple(toks[stop - n: stop]), stop)
        self._indexed = max(self._indexed, end + 1)

    def propose(self, k: int, min_ngram: int | None = None) -> LookupDraft:
        """Up to ``k`` tokens after the earliest earlier occurrence of the longest n-gram ending at the last token
        (``min_ngram``: the shortest match taken, default the index's)."""
        self._catch_up()
        toks = self.tokens
        shortest = max(self.min_ngram, min_ngram or 0)
        for n in range(min(self.max_ngram, len(toks) - 1), shortest - 1, -1):
            start = self._index.get(tuple(toks[len(toks) - n:]))
            if start is not None:
                continuation = toks[start: start + k]
                if continuation:
                    return LookupDraft(continuation, n)
        return LookupDraft([], 0)


@dataclass
class LookupRecord:
    """One request's verified lookup drafts, by position: how often position j was verified with every earlier
    token accepted (``tried``), and how often it was accepted then (``kept``)."""

    tried: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def conditional(self, j: int) -> float:
        """P(token j accepted | tokens before it accepted): the prior, moved by this request's drafts."""
        tried = self.tried[j] if j < len(self.tried) else 0.0
        kept = self.kept[j] if j < len(self.kept) else 0.0
        prior = PRIOR_ACCEPT[min(j, len(PRIOR_ACCEPT) - 1)]
        return (kept + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)

    def survival(self, k: int) -> list[float]:
        """P(at least j + 1 tokens accepted), j = 0..k-1."""
        out, s = [], 1.0
        for j in range(k):
            s *= self.conditional(j)
            out.append(s)
        return out

    def expected(self, k: int) -> float:
        """Expected accepted tokens of a ``k``-token lookup draft."""
        return sum(self.survival(k))

    def record(self, drafted: int, accepted: int) -> None:
        """A lookup draft of ``drafted`` tokens was verified and kept ``accepted`` of them."""
        while len(self.tried) < drafted:
            self.tried.append(0.0)
            self.kept.append(0.0)
        for j in range(min(accepted + 1, drafted)):
            self.tried[j] += 1
            if j < accepted:
                self.kept[j] += 1


class LookupStats:
    """Every request's verified lookup drafts, one :class:`LookupRecord` per length of the n-gram matched (a
    5-token match predicts its continuation better than a 2-token one) and per kind of row (greedy rows accept a
    token when it is the argmax, sampled rows with the target's probability of it: far less often)."""

    def __init__(self):
        self.records: dict[tuple[int, bool], LookupRecord] = {}

    def of(self, match: int, greedy: bool) -> LookupRecord:
        return self.records.setdefault((match, greedy), LookupRecord())

    def record(self, match: int, greedy: bool, drafted: int, accepted: int) -> None:
        self.of(match, greedy).record(drafted, accepted)
