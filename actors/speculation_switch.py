"""Load-aware speculation: stop drafting while the measured acceptance length makes it a loss.

Speculation pays when the tokens one speculative step commits per request (tau) outweigh how
much longer that step takes than a plain one:  tau > t_spec / t_plain.  ``t_spec`` is measured
(mean step time while speculating), ``t_plain`` comes from the scheduler's cost profile (the
target's measured forward time for a batch of one token per request). Below that break-even,
new requests decode plainly; after ``probe_interval_s`` speculation is switched back on to
measure again (the draft may fit the new traffic better). Requests already running keep their
mode; the decision is exported as ``dspark:speculation_enabled``. Seeded sampled requests keep speculating whatever
the switch says: whether a sampled request drafts decides its random draws, and a seeded one must give the same
tokens however busy the server is (greedy requests need no exception: on exact kernels drafting never changes them).
"""

from __future__ import annotations

import time

import torch

from dspark.decoding.engine import Engine


class SpeculationSwitch:
    def __init__(self, engine: Engine, window_steps: int = 50, probe_interval_s: float = 60.0, margin: float = 0.05):
        self.engine, self.window_steps = engine, window_steps
        self.probe_interval_s, self.margin = probe_interval_s, margin
        self._mark = self._snapshot()
        self._off_since: float | None = None
        self.decisions: list[tuple[float, bool, float, float]] = []  # (time, enabled, tau, break-even)

    def _snapshot(self) -> tuple[int, int, int, float, int]:
        m, e = self.engine.metrics, self.engine
        return m.completion_tokens, m.verify_steps, e.num_steps, e.timings["step"], len(e.running)

    def update(self) -> None:
        engine = self.engine
        if engine.drafter is None or engine.profile is None:
            return
        now = time.monotonic()
        if not engine.speculation_enabled:
            if now - self._off_since >= self.probe_interval_s:
                engine.speculation_enabled, self._off_since = True, None
                self._mark = self._snapshot()
                self.decisions.append((now, True, float("nan"), float("nan")))
            return
        tokens, rounds, steps, seconds, _ = (a - b for a, b in zip(self._snapshot(), self._mark))
        if steps < self.window_steps or rounds == 0:
            return
        tau = tokens / rounds
        batch = max(rounds / steps, 1.0)  # request-rounds per step
        t_spec = seconds / steps
        plain = self.engine.profile
        t_plain = float(plain.round_seconds(torch.tensor([batch])) - plain.draft_seconds)
        break_even = t_spec / max(t_plain, 1e-6)
        self._mark = self._snapshot()
        if tau < break_even * (1 - self.margin):
            engine.speculation_enabled, self._off_since = False, now
        self.decisions.append((now, engine.speculation_enabled, tau, break_even))

    def describe(self) -> dict:
        """The latest decision, for ``/health``: whether the replica speculates and the measurement behind it (tau:
        tokens per request-round over the last window; break_even: that window's step time over a plain step's)."""
        if not self.decisions:
            return {"enabled": self.engine.speculation_enabled, "decided": False, "window_steps": self.window_steps}
        at, enabled, tau, break_even = self.decisions[-1]
        measured = tau == tau  # a probe (switched back on) measured nothing: NaN
        return {"enabled": enabled, "decided": True, "tau": round(tau, 3) if measured else None,
                "break_even": round(break_even, 3) if measured else None,
                "seconds_ago": round(time.monotonic() - at, 1), "probe_interval_s": self.probe_interval_s,
                "decisions": len(self.decisions)}
