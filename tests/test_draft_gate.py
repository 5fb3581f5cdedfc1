"""The draft gate's rule (its losslessness in the engine: tests/test_greedy_lossless.py)."""

from __future__ import annotations

import pytest

from dspark.config import ConfigError
from dspark.decoding.draft_gate import DraftGate, DraftGateConfig, GateState
from dspark.decoding.scheduler import StepCostProfile


def test_break_even_comes_from_the_cost_table():
    # plain round 10 ms; a drafted round verifies 8 tokens (14 ms) after a 4 ms draft: pays above 0.8 tokens
    gate = DraftGate.from_profile(StepCostProfile((1, 8), (0.010, 0.014), 0.004), block_size=7)
    assert gate.break_even == pytest.approx(0.8)


def test_the_bar_rises_with_the_batch_where_verifying_more_tokens_costs_more():
    # target: 1 token 10 ms, 8 tokens 14 ms, 64 tokens 50 ms (a CPU: compute-bound past a few rows); draft pass 4 ms
    # for one row, 10 ms for eight. One request: (14 + 4) / 10 - 1 = 0.8. Eight requests drafting full blocks:
    # (50 + 10) / 14 - 1 = 3.29 tokens each, against 0.8 if the batch were ignored
    profile = StepCostProfile((1, 8, 64), (0.010, 0.014, 0.050), 0.004)
    gate = DraftGate.from_profile(profile, block_size=7, draft_seconds=lambda rows: 0.004 if rows == 1 else 0.010)
    assert gate.break_even == pytest.approx(0.8) and gate.at(1) == pytest.approx(0.8)
    assert gate.at(8) == pytest.approx((0.050 + 0.010) / 0.014 - 1)
    state = gate.new_state()  # starts at 1.0 accepted: drafts alone, not in a batch of eight
    assert gate.wants_draft(state, rows=1)
    gate.record(state, 1, rows=8)  # still 1.0: below the batch's bar, so it waits before its next probe
    assert not gate.wants_draft(state, rows=8)
    assert gate.wants_draft(state, rows=1)  # alone again, the same record pays
    # a pinned row's bar is the one-row bar whatever its batch (its draws depend on whether it drafts); greedy and
    # unseeded sampled rows weigh their batch
    assert DraftGate.batch_of(8, pinned=False) == 8 and DraftGate.batch_of(8, pinned=True) == 1
    # without a draft cost by rows the profile's one draft cost is used
    flat = DraftGate.from_profile(profile, block_size=7)
    assert flat.at(8) == pytest.approx((0.050 + 0.004) / 0.014 - 1)


def test_no_probe_where_even_a_full_block_could_not_lift_the_record_over_the_bar():
    """At a batch of 8 on a CPU the bar is 3.29 tokens: a record of 1.0 stays below it even after a probe that
    keeps all 7 drafted tokens (0.7 x 1.0 + 0.3 x 7 = 2.8), so the probe (a draft pass that catches up 8 rows'
    context, and a verify of 64 tokens) would not change a single decision: it is skipped. Alone, the same record
    pays and drafts; a record of 2.0 (2.0 x 0.7 + 2.1 = 3.5 over the bar) still probes at 8."""
    profile = StepCostProfile((1, 8, 64), (0.010, 0.014, 0.050), 0.004)
    gate = DraftGate.from_profile(profile, block_size=7, draft_seconds=lambda rows: 0.004 if rows == 1 else 0.010)
    low, high = GateState(1.0), GateState(2.0)
    assert not any(gate.wants_draft(low, rows=8, clock=c) for c in range(64))
    assert gate.wants_draft(low, rows=1, clock=0)
    assert any(gate.wants_draft(high, rows=8, clock=c) for c in range(64))
    no_limit = DraftGate(gate.break_even, gate.config, gate._by_rows)  # without a block size: every probe runs
    assert any(no_limit.wants_draft(GateState(1.0), rows=8, clock=c) for c in range(64))


def test_the_measured_draft_cost_by_rows_interpolates_between_measured_batches():
    from dspark.integrations.step_drafter import MeasuredCosts

    costs = MeasuredCosts(smoothing=1.0)
    assert costs.draft_seconds_at(4) == 0.0  # nothing measured
    costs.record_draft(0.010, rows=1)
    assert costs.draft_seconds_at(8) == pytest.approx(0.010)  # one batch measured: its cost
    costs.record_draft(0.024, rows=8)
    assert costs.draft_seconds_at(8) == pytest.approx(0.024)
    assert costs.draft_seconds_at(4) == pytest.approx(0.010 + 0.014 * 3 / 7)
    assert costs.draft_seconds_at(16) == pytest.approx(0.010 + 0.014 * 15 / 7)  # extrapolated along the line
    costs.record_draft(0.030, rows=2)  # noisy: more than at eight rows
    assert costs.draft_seconds_at(4) >= 0.030  # never below a measured smaller batch


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


def test_greedy_rows_probe_on_the_same_rounds_and_share_a_draft_pass():
    # two greedy rows that never accept a token, the second joining three rounds later: their waits double to the
    # cap (4) and, kept on the engine's clock, their probes fall on the same rounds (multiples of 4), one draft
    # pass for both; on their own counters (pinned rows) they stay three rounds apart
    gate = DraftGate(0.8, DraftGateConfig(smoothing=0.5, initial_accepted=1.0, max_backoff=4))

    def probes(aligned: bool) -> list[set[int]]:
        states = {0: gate.new_state()}
        rounds: list[set[int]] = [set(), set()]
        for clock in range(40):
            if clock == 3:
                states[1] = gate.new_state()
            for row, state in states.items():
                if gate.wants_draft(state, clock=DraftGate.clock_of(clock, pinned=not aligned)):
                    rounds[row].add(clock)
                    gate.record(state, 0)
        return rounds

    first, second = probes(aligned=True)
    assert sorted(first)[:5] == [0, 1, 2, 4, 8] and {c for c in first if c >= 8} == set(range(8, 40, 4))
    assert {c for c in second if c >= 8} == {c for c in first if c >= 8}  # in step from round 8 on
    apart = probes(aligned=False)
    assert {c for c in apart[0] if c >= 8}.isdisjoint({c for c in apart[1] if c >= 8})
    assert len(first | second) < len(apart[0] | apart[1])  # fewer rounds with a draft pass
    assert DraftGate.clock_of(7, pinned=True) is None and DraftGate.clock_of(7, pinned=False) == 7


def test_a_pinned_row_weighs_its_own_record_against_the_fixed_bar():
    """A seeded sampled row (pinned) ignores the measured break-even, whatever it is, for the configured fixed bar,
    and backs off over its own rounds: the same record gives the same decisions on any server."""
    config = DraftGateConfig(smoothing=0.5, initial_accepted=1.0, max_backoff=4, pinned_break_even=0.6)
    for measured in (0.1, 5.0):
        gate = DraftGate(measured, config)
        state = gate.new_state()
        decisions = []
        for accepted in (0, 0, 0, 3, 3):  # average 0.5, 0.25, 0.125: below 0.6; then 1.56: above
            rounds = 0
            while not gate.wants_draft(state, rows=8, pinned=True):
                rounds += 1
            decisions.append(rounds)
            gate.record(state, accepted, rows=8, pinned=True)
        assert decisions == [0, 1, 2, 4, 0]  # plain rounds before each drafted round: 1, 2, 4 while below the bar
        assert gate.wants_draft(state, pinned=True) and gate.at(8, pinned=True) == 0.6
    always = DraftGate(5.0, DraftGateConfig())  # pinned_break_even 0: a pinned row always drafts
    state = always.new_state()
    for _ in range(5):
        always.record(state, 0, pinned=True)
        assert always.wants_draft(state, pinned=True)


def test_bad_gate_settings_name_the_field():
    with pytest.raises(ConfigError, match="draft_gate.smoothing"):
        DraftGateConfig(smoothing=0)
    with pytest.raises(ConfigError, match="draft_gate.max_backoff"):
        DraftGateConfig(max_backoff=0)


def test_the_hybrid_takes_lookup_only_where_it_beats_both_the_head_and_plain_decoding():
    """Greedy, cost table measured: a lookup draft is this step's source when its expected tokens per second of
    step beat the head's and plain decoding's; a lookup that beats a weak head but not plain decoding leaves the
    step to the head's turn (where the draft gate skips a head below break-even). A greedy row's estimate pools
    every request's lookup drafts of the same match length; a seeded sampled row's is its own."""
    import torch

    from dspark.integrations.step_drafter import RowParams, StepDrafter, _Sequence

    drafter = StepDrafter(None, block_size=7, sources="hybrid")
    for _ in range(3):  # plain step 10 ms; 8 tokens 45 ms (a CPU where verifying costs): break-even is steep
        drafter.costs.record(1, 0.010)
        drafter.costs.record(8, 0.045)
    drafter.costs.record_draft(0.004)
    params = RowParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_total_tokens=1000)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]  # "5 6" recurs: a 2-token match, a 7-token draft

    def sequence() -> _Sequence:
        seq = _Sequence(torch.Generator(), drafter.choice.new_row(prompt))
        seq.row.head_accepted = 0.2  # a head that accepts little
        return seq

    # the prior (survival 0.7, 0.53, 0.42, 0.36, 0.30, 0.26, 0.22): E = 2.79 over 7 tokens; (1 + 2.79) / 45 ms =
    # 84 tok/s against plain 100 tok/s: lookup loses to plain decoding, though it beats the head (1.2 / 49 ms)
    assert drafter._choose(sequence(), 7, params, 1, drafter.profile) is None
    for _ in range(6):  # other requests' 2-token matches kept every token: P(kept) ~0.93 each, E ~5.4: 142 tok/s
        drafter.choice.lookup_stats.record(2, True, 7, 7)
    assert drafter._choose(sequence(), 7, params, 1, drafter.profile).tokens == [7, 8, 9, 10, 11, 12, 5]
    for _ in range(3):  # 15 tokens 90 ms: in a batch of 8 the same draft gives (8 + 5.4) / 90 ms = 149 tok/s
        drafter.costs.record(15, 0.090)  # against plain 8 / 45 ms = 178 tok/s: the bar rises with the batch
    assert drafter._choose(sequence(), 7, params, 8, drafter.profile) is None
    assert drafter._choose(sequence(), 7, params, 1, drafter.profile) is not None
    drafter.choice.lookup_stats.record(3, True, 7, 0)  # another match length's record is another estimate
    drafter.choice.lookup_stats.record(2, False, 7, 0)  # and sampled rows' records another
    assert drafter._choose(sequence(), 7, params, 1, drafter.profile) is not None
    # a seeded sampled row goes by its own drafts and the prior, whatever other requests verified
    pinned = RowParams(temperature=1.0, top_p=1.0, top_k=0, seed=7, max_total_tokens=1000)
    assert pinned.pinned
    seq = sequence()
    seq.row.head_accepted = 3.0  # E = 2.79 < 3.0: the head's turn
    assert drafter._choose(seq, 7, pinned, 1, drafter.profile) is None
    for _ in range(6):
        seq.row.record.record(7, 7)
    assert drafter._choose(seq, 7, pinned, 1, drafter.profile) is not None
    # before any cost table (and for sampled rows): lookup when its expected accepted tokens reach the head's
    fresh = StepDrafter(None, block_size=7, sources="hybrid")
    fresh_row = _Sequence(torch.Generator(), fresh.choice.new_row(prompt))
    assert fresh._choose(fresh_row, 7, params, 1, fresh.profile) is not None
    # only the last token recurs: a one-token match, which a greedy row may take and a pinned row does not (its own
    # record, over every match length, could not tell such guesses from its long matches)
    single = [5, 6, 7, 5]
    for row_params, taken in ((params, [6, 7, 5]), (pinned, None)):
        seq = _Sequence(torch.Generator(), fresh.choice.new_row(single))
        seq.row.head_accepted = 0.0
        choice = fresh._choose(seq, 7, row_params, 1, fresh.profile)
        assert (choice.tokens if choice is not None else None) == taken
        assert choice is None or choice.match == 1


def test_a_new_greedy_request_starts_from_what_the_servers_head_accepted():
    """Once the server's greedy requests have shown a head below break-even, a new greedy request probes its first
    round and then backs off (a probe every pooled_backoff rounds), not drafting from the optimistic start; a
    sampled request, whose draws must not depend on other traffic, still starts from the configured value."""
    from dspark.decoding.draft_gate import PooledAcceptance

    gate = DraftGate(1.5, DraftGateConfig(initial_accepted=1.0, max_backoff=4, pooled_backoff=8))
    pool = PooledAcceptance(min_rounds=16)
    for _ in range(15):
        pool.observe(0)
    assert pool.value is None  # too few rounds to speak for the server
    pool.observe(1)
    assert pool.value == pytest.approx(1 / 16)
    backed_off = gate.new_state(pool.value)
    assert gate.wants_draft(backed_off, 1, 1)  # its first round probes its own text
    gate.record(backed_off, 0)  # below break-even: one round in pooled_backoff from now on
    assert [gate.wants_draft(backed_off, 1, clock) for clock in range(2, 18)].count(True) == 2  # rounds 8, 16
    gate.record(backed_off, 0)  # a probe below break-even: the next one as far off (not max_backoff's 4)
    assert backed_off.period == 8 and backed_off.backoff == 8
    gate.record(backed_off, 6)  # a probe that pays (average 1.83 >= 1.5): drafting again, every round
    assert backed_off.period == 1 and gate.wants_draft(backed_off, 1, 3)
    fresh = gate.new_state(None)  # a sampled row
    assert fresh.accepted == 1.0 and gate.wants_draft(fresh)
    for _ in range(200):  # the head pays on this traffic: new greedy requests start where it stands
        pool.observe(3)
    assert gate.new_state(pool.value).accepted == pytest.approx(3.0, abs=0.01)


def test_a_requests_first_head_draft_stays_out_of_the_draft_passs_cost():
    """The draft pass's measured cost (what the gate's bar and the hybrid's choice weigh) is what drafting again
    costs: a pass that includes a request's first head draft, which also fuses that request's whole prompt, counts
    only while nothing else is measured."""
    import torch

    from dspark.integrations.step_drafter import RowParams, StepDrafter, StepRows
    from dspark.model.draft_model import DraftProposal

    class Drafter:  # the sequence interface of DSparkDrafter, drafting a fixed block
        def can_start_sequence(self, reservation):
            return True

        def start_sequence(self, handle, reservation):
            pass

        def release_sequence(self, handle):
            pass

        def commit(self, handles, kept, features):
            pass

        def draft(self, inputs, sampling):
            rows = len(inputs.request_ids)
            return DraftProposal(torch.full((rows, 3), 4), None, torch.full((rows, 3), 0.9))

    drafter = StepDrafter(Drafter(), block_size=3)
    params = RowParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_total_tokens=100)

    def step(ids, firsts, scheduled, drafted, committed):
        rows = StepRows(ids, firsts, scheduled, drafted, committed, torch.zeros(sum(scheduled), 8),
                        [params] * len(ids), prompts=[[1] * n if f == 0 else None for f, n in zip(firsts, scheduled)])
        return drafter.propose(rows)

    step(["a"], [0], [5], [0], [[9]])  # a's prompt, then its first draft: the only measurement so far
    first = drafter.costs.draft_seconds
    assert first is not None
    step(["a", "b"], [5, 0], [4, 5], [3, 0], [[4, 9], [9]])  # b's first draft shares the pass: not counted
    assert drafter.costs.draft_seconds == first
    step(["a", "b"], [7, 5], [4, 4], [3, 3], [[4, 4, 9], [4, 9]])  # both draft again: counted
    assert drafter.costs.draft_seconds != first
