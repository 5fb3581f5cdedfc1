"""The DSpark head drafting for a host engine that verifies by itself (vLLM), one call per engine step.

The host runs its target pass and its own rejection sampler; after each step it hands :class:`StepDrafter` what the
step did, row by row (:class:`StepRows`): which tokens each request ran, how many of them were drafts, which tokens
it committed, and the target's hidden states at the drafter's feature layers for every token it ran. The drafter
keeps, per request, the fused context of every committed position (its own paged cache, as in the native engine),
checks that the host's positions and its own context agree, and drafts the next block for every request that
committed a new token: tokens, the exact distributions they were drawn from (so sampled rows are verified
losslessly) and the confidences. The draft gate (per request: skip drafting while recent blocks accept less than
break-even) and the prefix scheduler (how many drafted tokens each row sends to verification) decide the lengths.

No vLLM here: ``dspark.integrations.vllm_compat`` turns vLLM's model-runner state into :class:`StepRows` and the
drafts back into what vLLM's scheduler and rejection sampler read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark.decoding.draft_gate import DraftGate, GateState
from dspark.decoding.drafter import DraftInputs
from dspark.decoding.sampling import SamplingTensors
from dspark.decoding.scheduler import StepCostProfile, schedule_full, schedule_prefix


@dataclass(frozen=True)
class RowParams:
    """What the drafter needs of one request's sampling parameters."""

    temperature: float
    top_p: float
    top_k: int  # 0 = off
    seed: int | None
    max_total_tokens: int  # prompt + output tokens the request may reach (bounded by the model length)


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


@dataclass
class StepDrafts:
    tokens: list[list[int]]  # per row: the draft tokens to verify next step ([] = decode plainly)
    draft_probs: torch.Tensor | None  # [rows, G, V] the distributions they were drawn from (None: all rows greedy)
    confidences: torch.Tensor | None  # [rows, G]


@dataclass
class StepDrafterStats:
    steps: int = 0
    drafted_rows: int = 0  # request-steps that drafted a block
    drafted_tokens: int = 0  # tokens drafted (before the scheduler)
    scheduled_tokens: int = 0  # tokens sent to verification (after it)
    gate_skips: int = 0  # request-steps the draft gate decoded plainly
    resyncs: int = 0  # requests whose context was out of step with the host (drafting stopped for them)
    draft_seconds: float = 0.0
    step_seconds: float = 0.0  # wall time between consecutive calls: the host's step, drafting included


class _Sequence:
    def __init__(self, generator: torch.Generator, gate: GateState | None):
        self.context = 0  # committed positions whose features the drafter holds (or has pending)
        self.generator = generator
        self.gate = gate
        self.broken = False  # out of step with the host: decodes plainly until it finishes


class StepDrafter:
    """Per-request context bookkeeping and batched block drafting around a drafter with the sequence interface of
    ``dspark.decoding.drafter.DSparkDrafter`` (``can_start_sequence`` / ``start_sequence`` / ``release_sequence`` /
    ``commit`` / ``draft``): the DSpark head over its paged context cache, in this process or behind an actor."""

    def __init__(self, drafter, block_size: int, seed: int = 0, scheduler: str = "full",
                 profile: StepCostProfile | None = None, gate: DraftGate | None = None):
        if scheduler == "confidence" and profile is None:
            raise ValueError("the confidence scheduler needs a step cost profile")
        self.drafter, self.block_size = drafter, block_size
        self.scheduler, self.profile, self.gate = scheduler, profile, gate
        self.seeds = torch.Generator().manual_seed(seed)  # seeds of requests that bring none
        self.sequences: dict[str, _Sequence] = {}
        self.stats = StepDrafterStats()
        self._last_call: float | None = None
        self._handles: dict[str, int] = {}  # host request id -> the drafter's integer sequence id
        self._next_handle = 0

    # ------------------------------------------------------------------------------------------------ lifecycle
    def _start(self, rid: str, params: RowParams) -> _Sequence | None:
        self._release(rid)
        handle = self._next_handle
        self._next_handle += 1
        if not self.drafter.can_start_sequence(params.max_total_tokens):
            return None  # no room in the draft context cache: this request decodes plainly
        self.drafter.start_sequence(handle, params.max_total_tokens)
        self._handles[rid] = handle
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self.seeds))
        seq = _Sequence(torch.Generator().manual_seed(seed), self.gate.new_state() if self.gate else None)
        self.sequences[rid] = seq
        return seq

    def _release(self, rid: str) -> None:
        self.sequences.pop(rid, None)
        handle = self._handles.pop(rid, None)
        if handle is not None:
            self.drafter.release_sequence(handle)

    def release_all(self) -> None:
        for rid in list(self.sequences):
            self._release(rid)

    # ------------------------------------------------------------------------------------------------ one step
    def propose(self, rows: StepRows) -> StepDrafts:
        now = time.perf_counter()
        if self._last_call is not None:
            self.stats.step_seconds += now - self._last_call
        self.stats.steps += 1
        for rid in rows.finished:
            self._release(rid)
        drafting: list[int] = []  # row indices that draft this step
        anchors, positions = [], []
        offsets = [0]
        for n in rows.num_scheduled:
            offsets.append(offsets[-1] + n)
        commit_ids, commit_counts, commit_slices = [], [], []
        for i, rid in enumerate(rows.request_ids):
            first, committed = rows.first_positions[i], rows.committed_tokens[i]
            seq = self.sequences.get(rid)
            if first == 0:
                seq = self._start(rid, rows.params[i])
            elif seq is not None and not seq.broken and seq.context != first:
                seq.broken = True  # preempted and resumed from a prefix we never saw, or a bug: stop drafting it
                self.stats.resyncs += 1
            if seq is None or seq.broken:
                continue
            if rows.num_drafted[i] and committed and seq.gate is not None and self.gate is not None:
                self.gate.record(seq.gate, len(committed) - 1)
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
            if seq.gate is not None and not self.gate.wants_draft(seq.gate):
                self.stats.gate_skips += 1
                continue
            drafting.append(i)
            anchors.append(committed[-1])
            positions.append(seq.context)
        if commit_ids:
            self.drafter.commit(commit_ids, commit_counts, torch.cat(commit_slices))
        tokens: list[list[int]] = [[] for _ in rows.request_ids]
        self._last_call = time.perf_counter()
        if not drafting:
            return StepDrafts(tokens, None, None)
        start = time.perf_counter()
        params = [rows.params[i] for i in drafting]
        sampling = SamplingTensors(
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            [self.sequences[rows.request_ids[i]].generator for i in drafting])
        handles = [self._handles[rows.request_ids[i]] for i in drafting]
        proposal = self.drafter.draft(DraftInputs(handles, torch.tensor(anchors), torch.tensor(positions)), sampling)
        budgets = torch.tensor([rows.params[i].max_total_tokens - positions[k] - 1
                                for k, i in enumerate(drafting)])  # [B]
        if self.scheduler == "confidence":
            lengths = schedule_prefix(proposal.confidences, self.profile, budgets.clamp(max=self.block_size))
        else:
            lengths = schedule_full(self.block_size, budgets)
        lengths_list = lengths.tolist()  # once per step, for the host's per-request lists
        block_tokens = proposal.tokens.tolist()
        for k, i in enumerate(drafting):
            tokens[i] = block_tokens[k][: lengths_list[k]]
        self.stats.drafted_rows += len(drafting)
        self.stats.drafted_tokens += proposal.tokens.numel()
        self.stats.scheduled_tokens += sum(lengths_list)
        probs = None
        if proposal.draft_probs is not None and not bool(sampling.greedy.all()):
            draft_probs = proposal.draft_probs.to_dense()  # [B, G, V]
            probs = draft_probs.new_zeros(len(rows.request_ids), *draft_probs.shape[1:])
            probs.index_copy_(0, torch.tensor(drafting), draft_probs)
        confidences = proposal.confidences.new_zeros(len(rows.request_ids), proposal.confidences.shape[1])
        confidences.index_copy_(0, torch.tensor(drafting), proposal.confidences)
        self.stats.draft_seconds += time.perf_counter() - start
        self._last_call = time.perf_counter()
        return StepDrafts(tokens, probs, confidences)
