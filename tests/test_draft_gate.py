"""The draft gate's rule (its losslessness in the engine: tests/test_greedy_lossless.py)."""

from __future__ import annotations

import pytest

from dspark.config import ConfigError
from dspark.decoding.draft_gate import DraftGate, DraftGateConfig
from dspark.decoding.scheduler import StepCostProfile


def test_break_even_comes_from_the_cost_table():
    # plain round 10 ms; a drafted round verifies 8 tokens (14 ms) after a 4 ms draft: pays above 0.8 tokens
    gate = DraftGate.from_profile(StepCostProfile((1, 8), (0.010, 0.014), 0.004), block_size=7)
    assert gate.break_even == pytest.approx(0.8)


def test_backoff_doubles_while_drafts_do_not_pay_and_resets_when_they_do():
    gate = DraftGate(0.8, DraftGateConfig(smoothing=0.5, initial_accepted=1.0, max_backoff=4))
    state = gate.new_state()
    decisions = []
    for _ in range(20):
        drafts = gate.wants_draft(state)
        decisions.append(drafts)
        if drafts:
            gate.record(state, 0)  # nothing ever accepted
    # 1.0 -> 0.5 falls below 0.8 on the first record; then waits of 1, 2, 4, 4, ... plain rounds between probes
    assert "".join("d" if d else "." for d in decisions) == "d.d..d....d....d...."
    gate.record(state, 3)  # a probe that pays brings the drafts back at once
    assert state.accepted >= 0.8 and all(gate.wants_draft(state) for _ in range(3))


def test_bad_gate_settings_name_the_field():
    with pytest.raises(ConfigError, match="draft_gate.smoothing"):
        DraftGateConfig(smoothing=0)
    with pytest.raises(ConfigError, match="draft_gate.max_backoff"):
        DraftGateConfig(max_backoff=0)
