"""The DSpark head drafting for a host engine that verifies by itself (vLLM), one call per engine step.

The host runs its target pass and its own rejection sampler; after each step it hands :class:`StepDrafter` what the
step did, row by row (:class:`StepRows`): which tokens each request ran, how many of them were drafts, which tokens
it committed, and the target's hidden states at the drafter's feature layers for every token it ran. The drafter
keeps, per request, the fused context of every committed position (its own paged cache, as in the native engine),
checks that the host's positions and its own context agree, and drafts the next block for every request that
committed a new token: tokens, the exact distributions they were drawn from (so sampled rows are verified
losslessly) and the confidences. The draft gate (per request: skip drafting while recent blocks accept less than
break-even) and the prefix scheduler (how many drafted tokens each row sends to verification) decide the lengths.

No vLLM here: ``dspark.integrations.vllm_0_32.proposer`` turns vLLM's model-runner state into :class:`StepRows` and the
drafts back into what vLLM's scheduler and rejection sampler read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark.config import GREEDY_BELOW
from dspark.decoding.draft_gate import DraftGate, DraftGateConfig, GateState, PooledAcceptance
from dspark.decoding.drafter import DrafterUnavailable, DraftInputs
from dspark.decoding.sampling import SamplingTensors
from dspark.decoding.scheduler import StepCostProfile, schedule_alone, schedule_full, schedule_prefix
from dspark.decoding.sources import SOURCES, DraftSources, LookupChoice, RowSources, SourceStats


@dataclass(frozen=True)
class RowParams:
    """What the drafter needs of one request's sampling parameters."""

    temperature: float
    top_p: float
    top_k: int  # 0 = off
    seed: int | None
    max_total_tokens: int  # prompt + output tokens the request may reach (bounded by the model length)
    speculate: bool = True  # False: the client (or the load-aware switch) asked for plain decoding

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def pinned(self) -> bool:
        """A seeded sampled request: its draws depend on what it drafts and how much of it is verified, so those
        follow its own record and fixed rules only (the gate's fixed bar, no start-up calibration, its draft trimmed
        alone by a fixed cost model) and never the server's measured costs or other requests: the same seed gives
        the same tokens alone or in any batch."""
        return self.seed is not None and not self.greedy


@dataclass
class StepRows:
    """One host engine step, rows in the host's batch order."""

    request_ids: list[str]
    first_positions: list[int]  # position of each row's first token run this step
    num_scheduled: list[int]  # tokens of the row run this step (prompt chunk, or last token + drafts)
    num_drafted: list[int]  # of those, draft tokens being verified
    committed_tokens: list[list[int]]  # tokens the step committed: accepted drafts + the new token; [] mid-prefill
    features: torch.Tensor  # [sum num_scheduled, K * hidden] target states at the feature layers, rows packed
    params: list[RowParams]
    finished: set[str] = field(default_factory=set)  # requests the host is done with (free their context)
    prompts: list[list[int] | None] | None = None  # per row starting this step (first position 0): its prompt ids


@dataclass
class StepDrafts:
    tokens: list[list[int]]  # per row: the draft tokens to verify next step ([] = decode plainly)
    draft_probs: torch.Tensor | None  # [rows, G, V] the distributions they were drawn from (None: no sampled row
    # drafted from the head; vLLM then takes every draft as a one-point distribution, which a lookup draft is)
    confidences: torch.Tensor | None  # [rows, G]


@dataclass
class StepDrafterStats:
    steps: int = 0
    drafted_rows: int = 0  # request-steps that drafted a block
    drafted_tokens: int = 0  # tokens drafted (before the scheduler)
    scheduled_tokens: int = 0  # tokens sent to verification (after it)
    gate_skips: int = 0  # request-steps the draft gate decoded plainly
    resyncs: int = 0  # requests whose context was out of step with the host (drafting stopped for them)
    drafter_failures: int = 0  # a remote drafter died or missed its deadline (that step decoded plainly)
    drafter_fallbacks: int = 0  # request-steps decoded plainly because a failed drafter took their context
    # the step timeline, seconds: the host waits ``draft_seconds`` for drafts (the whole draft pass in process, the
    # whole actor call without overlap, only what the host's own work between two steps did not cover with it);
    # ``drafter_seconds`` is the draft pass itself and ``transport_seconds`` the features' trip over the channel
    # (an actor's: its receive); ``overlap_seconds`` the host's work done while a draft was in flight
    draft_seconds: float = 0.0
    drafter_seconds: float = 0.0
    transport_seconds: float = 0.0
    overlap_seconds: float = 0.0
    overlapped_steps: int = 0  # steps whose drafts were collected after the host's bookkeeping (overlap)
    step_seconds: float = 0.0  # the host's steps less the waits for drafts: its target passes and bookkeeping
    sources: dict[str, SourceStats] = field(default_factory=lambda: {s: SourceStats() for s in SOURCES})
    head_passes_skipped: int = 0  # steps where every drafting row took lookup: no draft pass ran


GATE_REFRESH_STEPS = 16  # the draft gate is rebuilt from the cost table at most this often (or on a new count)


class MeasuredCosts:
    """The host's step time by tokens verified per step, measured on its own decode steps (an exponential moving
    average per token count), as the cost table the draft gate and the prefix scheduler read. A step counts only
    when every row decodes (a prompt chunk would inflate it); the time is from the end of one call to the start of
    the next, i.e. the host's target pass, sampling and bookkeeping, without the drafting between them."""

    def __init__(self, smoothing: float = 0.2, min_samples: int = 3):
        self.smoothing, self.min_samples = smoothing, min_samples
        self.seconds: dict[int, float] = {}
        self.samples: dict[int, int] = {}
        self.draft_seconds: float | None = None  # the draft pass, whatever its rows (the scheduler's sunk cost)
        self.draft_by_rows: dict[int, float] = {}  # the draft pass by rows drafted (the draft gate's d(R))

    def _average(self, old: float | None, seconds: float) -> float:
        return seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds

    def record(self, tokens: int, seconds: float) -> None:
        self.seconds[tokens] = self._average(self.seconds.get(tokens), seconds)
        self.samples[tokens] = self.samples.get(tokens, 0) + 1

    def record_draft(self, seconds: float, rows: int = 1) -> None:
        """A draft call's cost to the host: the whole call in process or without overlap; with the overlap only
        the wait it left (what the draft gate and the scheduler must weigh against the tokens it brings)."""
        self.draft_seconds = self._average(self.draft_seconds, seconds)
        self.draft_by_rows[rows] = self._average(self.draft_by_rows.get(rows), seconds)

    def draft_seconds_at(self, rows: int) -> float:
        """The draft pass for ``rows`` rows: measured, else linear between the measured row counts around it (past
        the measured ones: along the last two), never below the cost measured at fewer rows; one measured count:
        that cost."""
        table = self.draft_by_rows
        if rows in table:
            return table[rows]
        if not table:
            return self.draft_seconds or 0.0
        if len(table) == 1:
            return next(iter(table.values()))
        below, above = sorted(r for r in table if r < rows), sorted(r for r in table if r > rows)
        r0, r1 = (below[-1], above[0]) if below and above else (below[-2:] if below else above[:2])
        estimate = table[r0] + (table[r1] - table[r0]) * (rows - r0) / (r1 - r0)
        return max(estimate, max((table[r] for r in below), default=0.0), 0.0)

    def profile(self) -> StepCostProfile | None:
        """The table so far (at least two token counts measured ``min_samples`` times), None before that."""
        counts = sorted(n for n, k in self.samples.items() if k >= self.min_samples)
        if len(counts) < 2:
            return None
        seconds = [self.seconds[n] for n in counts]
        for i in range(1, len(seconds)):  # noise must not make a larger step look cheaper
            seconds[i] = max(seconds[i], seconds[i - 1])
        return StepCostProfile(tuple(counts), tuple(seconds), self.draft_seconds or 0.0)


class _Sequence:
    def __init__(self, generator: torch.Generator, row: RowSources):
        self.context = 0  # committed positions whose features the drafter holds (or has pending)
        self.generator = generator
        self.gate: GateState | None = None  # the draft gate's record, from the first step the gate exists
        self.broken = False  # out of step with the host: decodes plainly until it finishes
        self.row = row  # its part of the source choice (dspark.decoding.sources)
        self.head_drafted = False  # it has drafted from the head (its prompt's context is in the draft cache)


@dataclass
class _InFlight:
    """A step's draft call between :meth:`StepDrafter.submit` and :meth:`StepDrafter.collect`."""

    num_rows: int
    drafting: list[int]  # row indices that drafted
    positions: list[int]  # each drafting row's anchor position
    params: list[RowParams]  # each drafting row's
    greedy: bool  # every drafting (and lookup) row greedy (no draft distributions needed)
    started: float  # perf_counter when the call started
    submitted: float  # perf_counter when it was in flight (the host went on)
    ticket: object = None  # the drafter's handle on the call (submit_draft), or
    proposal: object = None  # the proposal itself (a drafter without submit_draft drafted at once)
    lookup: dict[int, list[int]] = field(default_factory=dict)  # row index -> its lookup draft
    lookup_conf: dict[int, list[float]] = field(default_factory=dict)  # row index -> P(token j kept | before kept)
    lookup_budget: dict[int, int] = field(default_factory=dict)  # row index -> tokens it may still verify
    pinned: set[int] = field(default_factory=set)  # row indices of seeded sampled rows (RowParams.pinned)
    first_draft: bool = False  # a row's first head draft is in it (the pass also fuses that row's whole prompt)


class StepDrafter:
    """Per-request context bookkeeping and batched block drafting around a drafter with the sequence interface of
    ``dspark.decoding.drafter.DSparkDrafter`` (``can_start_sequence`` / ``start_sequence`` / ``release_sequence`` /
    ``commit`` / ``draft``): the DSpark head over its paged context cache, in this process or behind an actor.

    Two ways to run a step: :meth:`propose` drafts and returns the drafts; :meth:`submit` starts the draft call and
    :meth:`collect` takes its drafts later, so that a drafter behind an actor (``submit_draft`` / ``draft_result``)
    drafts while the host does the rest of its step (the overlap; a drafter in this process drafts at submit).

    A remote drafter that fails (``DrafterUnavailable`` from ``commit`` or ``draft``) costs that step its drafts and
    every current request its context (held in the lost process): they finish decoding plainly, and requests that
    start once the drafter is back (``can_start_sequence``) speculate again. ``drafter`` None: nothing drafts
    until :meth:`attach` gives one."""

    def __init__(self, drafter, block_size: int, seed: int = 0, scheduler: str = "full", draft_gate: bool = False,
                 calibration_steps: int = 6, sources: str = "head", vocab_size: int | None = None,
                 pinned_break_even: float = 0.0, pinned_token_cost: float = 0.0):
        """``scheduler``: 'full' (every drafted token verified) or 'confidence' (Algorithm 1 over the measured cost
        table, full blocks until it has one); ``draft_gate``: per request, skip drafting below the measured
        break-even; ``calibration_steps``: plain decode steps at start-up that measure the cost of a plain step
        (only when the gate or the confidence scheduler needs the table); ``sources``: 'head' (the DSpark head),
        'lookup' (prompt lookup only) or 'hybrid' (per request and step, the source with more expected accepted
        tokens per unit of step cost: :meth:`_choose`); ``vocab_size``: the target's, for lookup drafts' one-point
        distributions when no head draft gives the shape; ``pinned_break_even``: with the gate, a pinned row's fixed
        bar (``DraftGateConfig.pinned_break_even``); ``pinned_token_cost``: with the confidence scheduler, the fixed
        cost model a pinned row trims its draft by alone (``schedule_alone``; 0: the full block)."""
        self.choice = DraftSources(sources, block_size)
        self.sources, self.vocab_size = sources, vocab_size
        self.drafter, self.block_size = drafter, block_size
        self.scheduler, self.use_gate = scheduler, draft_gate
        self.pinned_token_cost = pinned_token_cost if scheduler == "confidence" else 0.0
        self.costs = MeasuredCosts()
        self.calibration_left = calibration_steps if (draft_gate or scheduler == "confidence") else 0
        self.gate: DraftGate | None = None  # built once the cost table exists
        self.gate_config = DraftGateConfig(pinned_break_even=pinned_break_even)
        # pinned rows' gate: a fixed bar from their first step, whenever the cost table fills in
        self.pinned_gate = DraftGate(0.0, self.gate_config) if draft_gate else None
        self._gate_profile: StepCostProfile | None = None
        self._gate_step = 0  # the step it was built at
        self.seeds = torch.Generator().manual_seed(seed)  # seeds of requests that bring none
        self.sequences: dict[str, _Sequence] = {}
        self.head_pool = PooledAcceptance()  # greedy requests' verified head drafts: where a new one's gate starts
        self.stats = StepDrafterStats(sources=self.choice.stats)
        self._last_call: float | None = None
        self._handles: dict[str, int] = {}  # host request id -> the drafter's integer sequence id
        self._lost: set[str] = set()  # requests whose context a failed drafter took with it (decode plainly)
        self.verified: dict[str, int] = {}  # draft tokens each request had verified in the host's last step
        self.verified_sources: dict[str, str] = {}  # and where each of those drafts came from (head, lookup)
        self._sent: dict[str, int] = {}  # draft tokens handed to the host for its next step
        self._sent_sources: dict[str, str] = {}
        self._next_handle = 0
        self._in_flight: _InFlight | StepDrafts | None = None  # a submitted step not collected yet
        self._row_ids: list[str] = []  # its rows' request ids
        self._overlap = False
        self._waited = 0.0  # seconds the host waited for drafts since the last submit

    # ------------------------------------------------------------------------------------------------ lifecycle
    def attach(self, drafter) -> None:
        """Draft with ``drafter`` from now on (requests already running go on plainly: it holds no context of
        theirs)."""
        self.sequences.clear()
        self._handles.clear()
        self._in_flight = None
        self.drafter = drafter

    def _drafter_lost(self, rows_that_wanted: int) -> None:
        """A remote drafter failed: forget every sequence (their context is gone with it) and count it."""
        self._lost.update(self.sequences)
        self.sequences.clear()
        self._handles.clear()
        self.stats.drafter_failures += 1
        self.stats.drafter_fallbacks += rows_that_wanted

    def _start(self, rid: str, params: RowParams, prompt: list[int] | None = None) -> _Sequence | None:
        self._release(rid)
        self._lost.discard(rid)
        handle = self._next_handle
        self._next_handle += 1
        if self.drafter is None or not self.drafter.can_start_sequence(params.max_total_tokens):
            return None  # no room in the draft context cache: this request decodes plainly
        self.drafter.start_sequence(handle, params.max_total_tokens)
        self._handles[rid] = handle
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self.seeds))
        seq = _Sequence(torch.Generator().manual_seed(seed), self.choice.new_row(prompt))
        self.sequences[rid] = seq  # its gate record starts once the gate exists (see propose)
        return seq

    def _release(self, rid: str) -> None:
        self.sequences.pop(rid, None)
        handle = self._handles.pop(rid, None)
        if handle is not None:
            self.drafter.release_sequence(handle)

    # ------------------------------------------------------------------------------------------------ one step
    def propose(self, rows: StepRows) -> StepDrafts:
        """Bookkeeping of the step the host just ran, and the drafts of its next one. Afterwards ``verified`` says
        how many draft tokens each request had verified in the step just ran (the host's per-request counters)."""
        self.submit(rows, overlap=False)
        return self.collect()

    def submit(self, rows: StepRows, overlap: bool = True) -> None:
        """:meth:`propose` in two halves: the bookkeeping and the draft call now, the drafts from :meth:`collect`
        (before the host's next step). ``overlap``: the host works on between the two (its time then counts in
        ``stats.overlap_seconds``)."""
        if self._in_flight is not None:  # a host step failed between submit and collect: those drafts are stale
            self.collect()
            self._sent, self._sent_sources = {}, {}
        now = time.perf_counter()
        if self._last_call is not None:  # since the last submit: the host's step, less its waits for drafts
            host = now - self._last_call - self._waited
            self.stats.step_seconds += host
            if rows.request_ids and all(c for c in rows.committed_tokens):  # a decode step (no prompt chunk)
                self.costs.record(sum(rows.num_scheduled), host)
        self.verified, self.verified_sources = self._sent, self._sent_sources
        self._overlap = overlap
        self._in_flight = self._begin(rows)
        self._last_call = now
        self._waited = time.perf_counter() - now  # our bookkeeping, the features' send and the call (or the draft)

    @property
    def in_flight(self) -> bool:
        """A submitted step whose drafts :meth:`collect` has not taken yet."""
        return self._in_flight is not None

    def collect(self) -> StepDrafts:
        """The drafts of the step :meth:`submit` started."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            raise RuntimeError("StepDrafter.collect: no step submitted")
        drafts = pending if isinstance(pending, StepDrafts) else self._finish(pending)
        self._sent = {rid: len(t) for rid, t in zip(self._row_ids, drafts.tokens) if t}
        self._sent_sources = {rid: self.sequences[rid].row.source if rid in self.sequences else "head"
                              for rid in self._sent}
        return drafts

    def _begin(self, rows: StepRows) -> _InFlight | StepDrafts:
        """Bookkeeping, features to the drafter, and the draft call started: what :meth:`_finish` completes, or
        the step's drafts already (nothing drafts this step)."""
        self._row_ids = rows.request_ids
        self.stats.steps += 1
        self._refresh_gate()
        decoding = sum(1 for c in rows.committed_tokens if c)  # rows decoding together: the gate's batch
        profile = self.costs.profile()  # the cost table as of this step (the choices of its rows read it)
        for rid in rows.finished:
            self._release(rid)
            self._lost.discard(rid)
        drafting: list[int] = []  # row indices that draft this step with the head
        lookups: dict[int, LookupChoice] = {}  # row index -> its lookup draft
        anchors, positions = [], []
        offsets = [0]
        for n in rows.num_scheduled:
            offsets.append(offsets[-1] + n)
        commit_ids, commit_counts, commit_slices = [], [], []
        for i, rid in enumerate(rows.request_ids):
            first, committed = rows.first_positions[i], rows.committed_tokens[i]
            seq = self.sequences.get(rid)
            if first == 0:
                seq = self._start(rid, rows.params[i], rows.prompts[i] if rows.prompts is not None else None)
            elif seq is not None and not seq.broken and seq.context != first:
                seq.broken = True  # preempted and resumed from a prefix we never saw, or a bug: stop drafting it
                self.stats.resyncs += 1
            if seq is None or seq.broken:
                if committed and rid in self._lost and rows.params[i].speculate:
                    self.stats.drafter_fallbacks += 1
                continue
            pinned, gate = rows.params[i].pinned, self._gate_for(rows.params[i])
            if seq.gate is None and gate is not None:
                seq.gate = gate.new_state(self.head_pool.value if rows.params[i].greedy else None)
            batch = DraftGate.batch_of(decoding, pinned)
            if rows.num_drafted[i] and committed:
                self._record(seq, rows.num_drafted[i], len(committed) - 1, batch, rows.params[i])
            if committed:
                self.choice.extend(seq.row, committed)
            kept = rows.num_scheduled[i] if not committed else rows.num_scheduled[i] - rows.num_drafted[i] + \
                len(committed) - 1  # the row's last input token plus its accepted drafts (all of a prompt chunk)
            commit_ids.append(self._handles[rid])
            commit_counts.append(kept)
            commit_slices.append(rows.features[offsets[i]: offsets[i] + kept])
            seq.context = first + kept
            if not committed:
                continue  # mid-prefill: nothing to draft from yet
            budget = rows.params[i].max_total_tokens - seq.context - 1
            if budget <= 0:
                continue
            if not rows.params[i].speculate:
                continue
            lookup = self._choose(seq, min(budget, self.block_size), rows.params[i], batch, profile)
            if lookup is not None:
                lookups[i] = lookup
                continue
            if self.sources == "lookup":
                continue
            clock = DraftGate.clock_of(self.stats.steps, pinned)
            if seq.gate is not None and not gate.wants_draft(seq.gate, batch, clock, pinned):
                self.stats.gate_skips += 1
                continue
            drafting.append(i)
            anchors.append(committed[-1])
            positions.append(seq.context)
        tokens: list[list[int]] = [[] for _ in rows.request_ids]
        if commit_ids:
            try:
                self.drafter.commit(commit_ids, commit_counts, torch.cat(commit_slices))
            except DrafterUnavailable:
                self._drafter_lost(len(drafting))
                return StepDrafts(tokens, None, None)
        if (drafting or lookups) and self.calibration_left > 0:  # plain steps first: the cost table's plain points
            keep = [k for k, i in enumerate(drafting) if rows.params[i].pinned]
            drafting, anchors, positions = ([xs[k] for k in keep] for xs in (drafting, anchors, positions))
            lookups = {i: d for i, d in lookups.items() if rows.params[i].pinned}
            self.calibration_left -= not drafting and not lookups  # a plain step measured (pinned rows draft)
        if not drafting and not lookups:
            return StepDrafts(tokens, None, None)
        start = time.perf_counter()
        params = [rows.params[i] for i in drafting]
        every_greedy = all(rows.params[i].greedy for i in [*drafting, *lookups])
        for i, choice in lookups.items():
            self.choice.taken(self.sequences[rows.request_ids[i]].row, choice)
        for i in drafting:
            self.choice.taken(self.sequences[rows.request_ids[i]].row, None)
        if not drafting:  # every drafting row took lookup: no draft pass this step
            self.stats.head_passes_skipped += 1
            flight = _InFlight(len(rows.request_ids), [], [], [], every_greedy, start, time.perf_counter())
            flight.pinned = {i for i in lookups if rows.params[i].pinned}
            self._add_lookups(flight, lookups, rows)
            return flight
        sampling = SamplingTensors(
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            [self.sequences[rows.request_ids[i]].generator for i in drafting])
        handles = [self._handles[rows.request_ids[i]] for i in drafting]
        inputs = DraftInputs(handles, torch.tensor(anchors), torch.tensor(positions))
        flight = _InFlight(len(rows.request_ids), drafting, positions, params, every_greedy, start, 0.0)
        flight.pinned = {i for i in [*drafting, *lookups] if rows.params[i].pinned}
        for i in drafting:
            seq = self.sequences[rows.request_ids[i]]
            flight.first_draft |= not seq.head_drafted
            seq.head_drafted = True
        self._add_lookups(flight, lookups, rows)
        try:
            if hasattr(self.drafter, "submit_draft"):  # behind an actor: it drafts while the host goes on
                flight.ticket = self.drafter.submit_draft(inputs, sampling)
            else:
                flight.proposal = self.drafter.draft(inputs, sampling)
        except DrafterUnavailable:
            self._drafter_lost(len(drafting))
            return StepDrafts(tokens, None, None)
        flight.submitted = time.perf_counter()
        return flight

    def _finish(self, flight: _InFlight) -> StepDrafts:
        """The drafts of a started call: wait for them, then the prefix scheduler's lengths per row."""
        resumed = time.perf_counter()
        drafting, positions = flight.drafting, flight.positions
        tokens: list[list[int]] = [[] for _ in range(flight.num_rows)]
        proposal = None
        if drafting:
            try:
                proposal = flight.proposal if flight.ticket is None else self.drafter.draft_result(flight.ticket)
            except DrafterUnavailable:
                self._drafter_lost(len(drafting))
                self._waited += time.perf_counter() - resumed
                drafting = []
        lookup_rows = list(flight.lookup)
        if not drafting and not lookup_rows:
            return StepDrafts(tokens, None, None)
        # one schedule over both sources' rows: [head rows, then lookup rows], conditionals c[r, j]: [B, G]
        block = self.block_size
        conf_rows = [proposal.confidences.float()] if drafting else []
        if lookup_rows:
            conf_rows.append(torch.tensor([(flight.lookup_conf[i] + [0.0] * block)[:block] for i in lookup_rows]))
        confidences_all = torch.cat(conf_rows)  # [B, G]
        head_budgets = [p.max_total_tokens - positions[k] - 1 for k, p in enumerate(flight.params)] if drafting else []
        budgets = torch.tensor(head_budgets + [flight.lookup_budget[i] for i in lookup_rows], dtype=torch.long)  # [B]
        profile = self.costs.profile() if self.scheduler == "confidence" else None
        if profile is not None:
            lengths = schedule_prefix(confidences_all, profile, budgets.clamp(max=block))
        else:
            lengths = schedule_full(block, budgets)
        if flight.pinned:  # seeded sampled rows: each trimmed alone by a fixed cost model (RowParams.pinned)
            pinned = torch.tensor([i in flight.pinned for i in drafting + lookup_rows])  # [B]
            lengths = torch.where(pinned, schedule_alone(confidences_all, self.pinned_token_cost,
                                                         budgets.clamp(max=block)), lengths)
        lengths_list = lengths.tolist()  # once per step, for the host's per-request lists
        if drafting:
            block_tokens = proposal.tokens.tolist()
            for k, i in enumerate(drafting):
                tokens[i] = block_tokens[k][: lengths_list[k]]
            self.stats.drafted_rows += len(drafting)
            self.stats.drafted_tokens += proposal.tokens.numel()
        for k, i in enumerate(lookup_rows):
            tokens[i] = flight.lookup[i][: lengths_list[len(drafting) + k]]
        self.stats.scheduled_tokens += sum(lengths_list)
        # The distributions the drafts were drawn from, [rows, G, V], where a sampled row drafted from the head. A
        # lookup draft is a one-point distribution at each of its tokens, which is what vLLM's rejection sampler
        # assumes of every draft when a step sends none (as for its own prompt lookup): a step without a sampled
        # head draft sends none, and spares the verify a dense [rows, G, V] it would only read back as one-hots.
        probs = None
        if not flight.greedy and drafting and proposal.draft_probs is not None:
            draft_probs = proposal.draft_probs.to_dense()  # [B, G, V]
            probs = draft_probs.new_zeros(flight.num_rows, *draft_probs.shape[1:])
            probs.index_copy_(0, torch.tensor(drafting), draft_probs)
            for i in lookup_rows:
                for j, token in enumerate(tokens[i]):
                    probs[i, j, token] = 1.0
        confidences = confidences_all.new_zeros(flight.num_rows, block)
        confidences.index_copy_(0, torch.tensor(drafting + lookup_rows), confidences_all)
        done = time.perf_counter()
        self._waited += done - resumed
        away = resumed - flight.submitted  # the host's own work while the call ran (~0 without overlap)
        waited = done - flight.started - away  # what drafting cost the host: the call, less what it overlapped
        timing = getattr(self.drafter, "last_timing", None) if flight.ticket is not None else None
        self.stats.draft_seconds += waited
        self.stats.drafter_seconds += timing["draft_s"] if timing else waited
        self.stats.transport_seconds += timing.get("recv_s", 0.0) if timing else 0.0
        if self._overlap:
            self.stats.overlap_seconds += away
            self.stats.overlapped_steps += 1
        # the draft pass's cost to the gate and the choice: what drafting again costs a row that drafts, so a pass
        # that first fuses a request's prompt (once per request: ~18 ms for 150 tokens against ~10 ms on this
        # CPU) counts only while nothing else is measured
        if drafting and (not flight.first_draft or self.costs.draft_seconds is None):
            self.costs.record_draft(waited, len(drafting))
        return StepDrafts(tokens, probs, confidences)

    # ------------------------------------------------------------------------------------------------ sources
    def _choose(self, seq: _Sequence, k: int, params: RowParams, batch: int,
                profile: StepCostProfile | None) -> LookupChoice | None:
        """The request's lookup draft if lookup is this step's source for it, else None (the head's turn, or
        nothing): :meth:`DraftSources.choose`, against the head's expected accepted tokens (the gate's record,
        else the request's own average) and, but for pinned rows, the measured cost table and draft pass at the
        ``batch`` decoding (``DraftGate.batch_of``); ``profile``: the step's cost table."""
        head = seq.gate.accepted if seq.gate is not None else seq.row.head_accepted
        profile = None if params.pinned else profile  # a pinned row's choice: its own record only
        return self.choice.choose(seq.row, k, params.greedy, params.pinned, head, profile,
                                  self.costs.draft_seconds_at(1) if profile is not None else 0.0, batch)

    def _add_lookups(self, flight: _InFlight, lookups: dict[int, LookupChoice], rows: StepRows) -> None:
        for i, choice in lookups.items():
            seq = self.sequences[rows.request_ids[i]]
            flight.lookup[i] = choice.tokens
            flight.lookup_conf[i] = choice.conditionals
            flight.lookup_budget[i] = min(len(choice.tokens), rows.params[i].max_total_tokens - seq.context - 1)

    def _record(self, seq: _Sequence, drafted: int, accepted: int, batch: int, params: RowParams) -> None:
        """A draft of the request was verified: ``accepted`` of its ``drafted`` tokens kept."""
        if self.choice.record(seq.row, drafted, accepted, params.greedy) == "lookup":
            return
        if seq.gate is not None:
            self._gate_for(params).record(seq.gate, accepted, batch, params.pinned)
        if params.greedy:
            self.head_pool.observe(accepted)

    def _gate_for(self, params: RowParams) -> DraftGate | None:
        """The gate a row answers to: pinned rows the fixed-bar one (there from the first step), the rest the
        measured one (once the cost table exists)."""
        return self.pinned_gate if params.pinned else self.gate

    def _refresh_gate(self) -> None:
        """The draft gate's break-even from the cost table and the draft pass by rows (rebuilt as they fill in;
        the requests' records live in their sequences, not in the gate)."""
        if not self.use_gate:
            return
        profile = self.costs.profile()
        if profile is None or profile == self._gate_profile:
            return
        # every decode step moves the table's averages a little: rebuild (and re-derive the bar at each batch)
        # when a token count joins it or every GATE_REFRESH_STEPS steps, not at every step (at 8 rows ~0.3 ms each)
        old = self._gate_profile
        if old is not None and old.token_counts == profile.token_counts \
                and self.stats.steps - self._gate_step < GATE_REFRESH_STEPS:
            return
        self._gate_profile, self._gate_step = profile, self.stats.steps
        self.gate = DraftGate.from_profile(profile, self.block_size, self.gate_config,
                                           draft_seconds=self.costs.draft_seconds_at)

    @property
    def profile(self) -> StepCostProfile | None:
        return self.costs.profile()
