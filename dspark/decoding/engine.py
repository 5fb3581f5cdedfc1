"""The in-process engine: continuous batching with DSpark speculative decoding.

Each ``step`` reads top to bottom: schedule (admit, choose prefill and decode batches) ->
draft -> (confidence) schedule the verified prefix -> verify -> commit -> emit. With
``speculate=False`` (or no drafter) the very same loop verifies zero-length drafts, which
is plain autoregressive decoding: the baseline of every comparison.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from dspark.config import ConfigError, EngineConfig, SamplingParams
from dspark.decoding.draft_gate import DraftGate, DraftGateConfig, PooledAcceptance
from dspark.decoding.drafter import Drafter
from dspark.decoding.metrics import SpecMetrics
from dspark.decoding.request import Request, RequestOutput, Status
from dspark.decoding.sampling import SamplingTensors
from dspark.decoding.scheduler import StepCostProfile, schedule_alone, schedule_full, schedule_prefix
from dspark.decoding.sources import DraftSources, LookupChoice
from dspark.decoding.target_runner import TargetRunner, VerifyBatch, VerifyOutput
from dspark.model.draft_model import DraftProposal
from dspark.model.target_model import TargetModel


@dataclass
class GenerationResult:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: SpecMetrics


@dataclass
class _Round:
    """One verify pass over a group of requests."""

    requests: list[Request]
    proposal: DraftProposal | None
    lengths: torch.Tensor  # [B] draft tokens verified per request
    drafted: torch.Tensor | None = None  # [B] bool, rows with a drafted block (None: all rows if proposal)


@dataclass
class _Draft:
    """The blocks asked for one group's next round: its rows, those drafting (the rest the gate held back)
    and the drafter's handle (None when nobody drafts)."""

    group: int
    requests: list[Request]
    drafting: list[Request]
    handle: object | None
    start_ns: int
    lookups: list[tuple[Request, LookupChoice]] = field(default_factory=list)  # rows drafting by prompt lookup

    @property
    def verifies(self) -> bool:
        """Something to verify: the head's blocks (asked for), or lookup drafts (no draft pass)."""
        return self.handle is not None or bool(self.lookups)


def check_request(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """What every backend refuses before queueing a request (ConfigError naming the field)."""
    if not prompt_ids:
        raise ConfigError("prompt", "must not be empty")
    if len(prompt_ids) >= max_model_len:
        raise ConfigError("prompt", f"{len(prompt_ids)} tokens do not fit the context of {max_model_len} tokens")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise ConfigError(
            "max_tokens", f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds {max_model_len}"
        )
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ConfigError("prompt", f"token ids must be in [0, {vocab_size})")


def _concat(head: DraftProposal, lookup: DraftProposal) -> DraftProposal:
    """The head's rows, then lookup's, as one proposal; a side without distributions (its rows greedy) gets zeros
    where the other has them."""
    def probs(p: DraftProposal, like: torch.Tensor) -> torch.Tensor:  # [rows, G, V]
        if p.draft_probs is not None:
            return p.draft_probs.to_dense().to(like.dtype)
        return like.new_zeros(len(p.tokens), *like.shape[1:])

    draft_probs = None
    if head.draft_probs is not None or lookup.draft_probs is not None:
        like = (head.draft_probs if head.draft_probs is not None else lookup.draft_probs).to_dense()
        draft_probs = torch.cat([probs(head, like), probs(lookup, like)])
    return DraftProposal(torch.cat([head.tokens, lookup.tokens.to(head.tokens.dtype)]), draft_probs,
                         torch.cat([head.confidences.float(), lookup.confidences]))


class Engine:
    """``target`` is a TargetModel (run in this process) or any object with ``TargetRunner``'s
    interface (``config``, ``allocator``, ``run``, ``forward``), such as the Ray router's handle
    on its target shard actors; ``drafter`` runs in this process or is a handle on a drafter actor."""

    overlap_drafts = False  # ask for a group's next draft as soon as its round commits (a remote drafter)

    def __init__(
        self,
        target: TargetModel | TargetRunner,
        tokenizer,
        drafter: Drafter | None,
        config: EngineConfig,
        feature_layers: tuple[int, ...] = (),
        profile: StepCostProfile | None = None,
    ):
        self.tokenizer, self.config = tokenizer, config
        self.drafter = drafter if config.speculate else None
        self.block_size = self.drafter.block_size if self.drafter else 0
        num_layers = target.config.num_layers
        if self.drafter is not None:
            bad = [i for i in feature_layers if i >= num_layers]
            if bad:
                raise ConfigError("aux_hidden_state_layer_ids", f"outputs of layers {bad} requested from a target "
                                                                f"with {num_layers} layers")
        if isinstance(target, TargetModel):
            cache = target.make_cache(config.kv_cache_tokens, config.kv_block_size)
            target = TargetRunner(target, cache, feature_layers if self.drafter else (), config.verification)
        self.target = target
        self.allocator = target.allocator
        self.eos_ids = self._eos_ids(tokenizer)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.metrics = SpecMetrics()
        self.dtypes: dict[str, dict] = {}  # how the builder chose each part's dtype (reported by /health, bench)
        self.num_steps = 0
        self.speculation_enabled = True  # new requests speculate (a load-aware switch may turn this off)
        # tracing hook: on_phase(name, start_ns, end_ns, request_ids, per_request attributes)
        self.on_phase: Callable[[str, int, int, list[int], dict[str, list]], None] | None = None
        self.timings = {"draft": 0.0, "schedule": 0.0, "verify": 0.0, "step": 0.0}  # seconds, cumulative
        self._ids = itertools.count()
        self._drafts: dict[int, _Draft] = {}  # a group's next-round draft, asked for early (overlap_drafts)
        self.profile = profile
        if self.drafter is not None and (config.scheduler == "confidence" or config.draft_gate) and profile is None:
            self.profile = self.measure_profile()
        self.gate = (DraftGate.from_profile(self.profile, self.block_size,
                                            DraftGateConfig(pinned_break_even=config.pinned_break_even))
                     if self.drafter is not None and config.draft_gate else None)
        self.head_pool = PooledAcceptance()  # greedy requests' drafted rounds: where a new one's gate starts
        # engine.draft_sources: the head, prompt lookup, or per request and round the one expected to pay more
        self.sources = DraftSources(config.draft_sources, self.block_size)

    # ------------------------------------------------------------------ requests
    @staticmethod
    def _eos_ids(tokenizer) -> set[int]:
        if tokenizer is None:
            return set()
        ids = set()
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = tokenizer.convert_tokens_to_ids(token) if token in tokenizer.get_vocab() else None
            if tid is not None:
                ids.add(int(tid))
        return ids

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None,
                    speculate: bool = True) -> int:
        """Queue a request; ``speculate=False`` decodes it without drafting (a plain-decoding baseline)."""
        check_request(prompt_ids, params, self.config.max_model_len, self.target.config.vocab_size)
        rid = next(self._ids) if request_id is None else request_id
        request = Request(rid, list(prompt_ids), params)
        request.wants_speculation = speculate
        if self.allocator.blocks_for(request.reservation) > self.allocator.usable_blocks:
            raise ConfigError("max_tokens", "request can never fit the KV cache: lower max_tokens or the prompt")
        self.requests[rid] = request
        self.waiting.append(request)
        return rid

    def abort(self, request_id: int) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.status != Status.FINISHED:
            self._finish(request, "abort")

    @property
    def draft_sources(self) -> dict[str, dict] | None:
        """Counters by draft source (head, lookup; ``engine.draft_sources``): drafts, tokens, accepted, per
        position (None without a drafter)."""
        return self.sources.as_dict() if self.drafter is not None else None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def shutdown(self) -> None:
        """As ``VllmEngine.shutdown``; this engine owns no processes or threads, so there is nothing to release."""

    def reset_transient_state(self) -> None:
        """After a failed step, once its requests are aborted: drop drafts asked for ahead of the next round."""
        self._drafts.clear()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One decoding round for every running request (the only copy: the Ray router runs this too)."""
        started = time.perf_counter()
        prefill, decode = self._schedule()
        drafting_on = self.drafter is not None and self.drafter.available
        speculative = [r for r in decode if r.speculative and drafting_on]
        drafts = self._drafts_for(speculative)
        held = [r for d in drafts if not d.verifies for r in d.requests if r.status == Status.RUNNING]
        plain = [r for r in decode if not (r.speculative and drafting_on)] + held
        for group in (prefill, plain):  # prompts in a pass of their own (decode rows are not padded to a prompt);
            if group:                   # plain decoding and rows the gate held back: one pass (features still flow)
                self._run_round(_Round(group, None, torch.zeros(len(group), dtype=torch.long)))
        for draft in drafts:
            if draft.verifies:
                self._verify_draft(draft)
                if self.overlap_drafts and self.drafter.available:  # draft the group's next round now
                    self._drafts[draft.group] = self._ask_draft(draft.group, self._members(draft.group))
        outputs = self._emit(prefill + decode)
        self.timings["step"] += time.perf_counter() - started
        self.num_steps += 1
        return outputs

    def _group(self, request: Request) -> int:
        """Which draft group a request belongs to (one here; the pipelined router alternates two)."""
        return 0

    def _members(self, group: int) -> list[Request]:
        return [r for r in self.running if r.status == Status.RUNNING and r.speculative and self._group(r) == group]

    def _drafts_for(self, speculative: list[Request]) -> list[_Draft]:
        """This round's draft of every group: one asked for after the group's last round (overlap), else now.
        A request that joined its group after that draft was asked for waits for the group's next round."""
        groups = sorted({self._group(r) for r in speculative} | set(self._drafts))
        drafts = [self._drafts.pop(g, None) or self._ask_draft(g, [r for r in speculative if self._group(r) == g])
                  for g in groups]
        return [d for d in drafts if d.requests]

    def _ask_draft(self, group: int, requests: list[Request]) -> _Draft:
        """Decide who drafts and from what (prompt lookup or the head: ``DraftSources``; for the head the gate,
        once per round) and submit the head's blocks to the drafter."""
        requests = [r for r in requests if r.num_cached > 0]  # prefilled: its context features are committed
        drafting, lookups = [], []
        for request in requests:  # but for pinned rows: the bar of a round of len(requests) decoding together
            choice = self._lookup_choice(request, len(requests))
            self.sources.taken(request.sources, choice)
            if choice is not None:
                lookups.append((request, choice))
                continue
            if self.sources.sources == "lookup":
                continue
            batch = DraftGate.batch_of(len(requests), request.params.pinned)
            clock = DraftGate.clock_of(self.num_steps, request.params.pinned)
            if request.gate is None or self.gate.wants_draft(request.gate, batch, clock, request.params.pinned):
                drafting.append(request)
            else:
                request.metrics.draft_skips += 1
                self.metrics.draft_skips += 1
        t0, start_ns = time.perf_counter(), time.time_ns()
        handle = self.drafter.submit(drafting, self._sampling(drafting)) if drafting else None
        self.timings["draft"] += time.perf_counter() - t0
        return _Draft(group, requests, drafting, handle, start_ns, lookups)

    def _lookup_choice(self, request: Request, rows: int) -> LookupChoice | None:
        """The request's lookup draft this round, if lookup is its source (``DraftSources.choose``): against its
        head's expected accepted tokens and, but for pinned rows, the profiled costs at ``rows`` decoding."""
        if self.sources.head_only:
            return None
        head = request.gate.accepted if request.gate is not None else request.sources.head_accepted
        profile = None if request.params.pinned else self.profile  # a pinned row's choice: its own record only
        return self.sources.choose(request.sources, self._max_length(request), request.params.greedy,
                                   request.params.pinned, head, profile,
                                   profile.draft_seconds if profile is not None else 0.0,
                                   DraftGate.batch_of(rows, request.params.pinned))

    def _verify_draft(self, draft: _Draft) -> None:
        """Wait for a group's blocks, schedule the verified prefixes, verify and commit (requests that finished
        while their block was drafted drop out; a failed drafter leaves the group to plain decoding)."""
        t0 = time.perf_counter()
        proposal = None
        if draft.handle is not None:
            proposal = self.drafter.result(draft.handle) if self.drafter.available else None  # None: failed
        t1 = time.perf_counter()
        self.timings["draft"] += t1 - t0  # in-process: ~0 (drafted at submit); remote: the wait
        requests = [r for r in draft.requests if r.status == Status.RUNNING]
        if draft.handle is None:  # every drafting row took lookup: no draft pass this round
            self._verify_lookups(draft, requests, t1)
            return
        if proposal is None:  # the drafter failed: these requests decode without it from now on
            for request in requests:
                request.speculative = False
            self.metrics.drafter_fallbacks += len(requests)
            self._drafts.clear()
            if requests:
                self._run_round(_Round(requests, None, torch.zeros(len(requests), dtype=torch.long)))
            return
        self._on_draft(draft)
        keep = [i for i, r in enumerate(draft.drafting) if r.status == Status.RUNNING]
        drafting = [draft.drafting[i] for i in keep]
        if not drafting:
            self._verify_lookups(draft, requests, t1)
            return
        proposal = proposal.rows(keep)
        lookups = [(r, c) for r, c in draft.lookups if r.status == Status.RUNNING]
        if lookups:  # one verify pass over both sources' rows: the head's, then lookup's
            proposal = _concat(proposal, self._lookup_proposal([c for _, c in lookups], requests))
            drafting = drafting + [r for r, _ in lookups]
        round_ = self._drafted_round(requests, drafting, proposal, {id(r): c for r, c in lookups})
        self.timings["schedule"] += time.perf_counter() - t1
        self._run_round(round_)

    def _verify_lookups(self, draft: _Draft, requests: list[Request], t1: float) -> None:
        """A round with no head blocks: the lookup rows' drafts (if any still run) verified, the rest plainly."""
        lookups = [(r, c) for r, c in draft.lookups if r.status == Status.RUNNING]
        if not lookups:
            if requests:
                self._run_round(_Round(requests, None, torch.zeros(len(requests), dtype=torch.long)))
            return
        proposal = self._lookup_proposal([c for _, c in lookups], requests)
        round_ = self._drafted_round(requests, [r for r, _ in lookups], proposal, {id(r): c for r, c in lookups})
        self.timings["schedule"] += time.perf_counter() - t1
        self._run_round(round_)

    def _lookup_proposal(self, choices: list[LookupChoice], requests: list[Request]) -> DraftProposal:
        """Lookup drafts as a proposal: tokens [L, G] (zeros past each draft, never verified: ``_max_lengths``),
        their conditionals as confidences [L, G], and, when the round verifies sampled rows (``requests``), their
        distributions: one-point [L, G, V] (a lookup token is accepted with the target's probability of it)."""
        block = self.block_size
        tokens = torch.zeros(len(choices), block, dtype=torch.long)  # [L, G]
        confidences = torch.zeros(len(choices), block)  # [L, G]
        for b, choice in enumerate(choices):
            tokens[b, : len(choice.tokens)] = torch.tensor(choice.tokens)
            confidences[b, : len(choice.conditionals)] = torch.tensor(choice.conditionals)
        draft_probs = None
        if not all(r.params.greedy for r in requests):
            draft_probs = torch.zeros(len(choices), block, self.target.config.vocab_size)  # [L, G, V]
            draft_probs.scatter_(2, tokens[:, :, None], 1.0)  # past a draft: never verified
        return DraftProposal(tokens, draft_probs, confidences)

    def _on_draft(self, draft: _Draft) -> None:
        self._phase("draft", draft.start_ns, draft.drafting)

    def _run_round(self, round_: _Round) -> None:
        """Verify one round on the target and commit it."""
        t0, start_ns = time.perf_counter(), time.time_ns()
        prefill = [r.num_cached == 0 for r in round_.requests] if self.on_phase is not None else []
        output = self.target.run(self._verify_batch(round_))
        self.timings["verify"] += time.perf_counter() - t0
        self._commit(round_, output)
        if self.on_phase is not None:  # tracing only: no extra work on the hot path otherwise
            self._phase("verify", start_ns, round_.requests, prefill=prefill,
                        verified=round_.lengths.tolist(), accepted=output.result.num_accepted.tolist())

    def _phase(self, name: str, start_ns: int, requests: list[Request], **per_request: list) -> None:
        if self.on_phase is not None:
            self.on_phase(name, start_ns, time.time_ns(), [r.request_id for r in requests], per_request)

    def _schedule(self) -> tuple[list[Request], list[Request]]:
        """Admit waiting requests while sequence slots and cache reservations allow."""
        decode = [r for r in self.running if r.status == Status.RUNNING]
        prefill = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.allocator.can_reserve(request.reservation):
                break
            # a seeded sampled request ignores the load-aware switch: whether it drafts decides its random draws
            seeded = request.params.pinned
            speculative = (request.wants_speculation and self.drafter is not None and self.drafter.available
                           and (self.speculation_enabled or seeded))
            if speculative and not self.drafter.can_start(request):
                break
            self.waiting.popleft()
            self.allocator.reserve(request.request_id, request.reservation)
            request.speculative = speculative
            if speculative:
                self.drafter.start(request)
                pooled = self.head_pool.value if request.params.greedy else None
                request.gate = self.gate.new_state(pooled) if self.gate is not None else None
                request.sources = self.sources.new_row(request.prompt_ids)
            request.status = Status.RUNNING
            self.running.append(request)
            prefill.append(request)
        return prefill, decode

    def _sampling(self, requests: list[Request]) -> SamplingTensors:
        return SamplingTensors.build([r.params for r in requests], [r.generator for r in requests])

    def _drafted_round(self, requests: list[Request], drafting: list[Request], proposal: DraftProposal,
                       lookups: dict[int, LookupChoice] | None = None) -> _Round:
        """One verify pass for ``requests``; those the gate held back ride along with nothing to verify."""
        lengths = self._schedule_verify(drafting, proposal, lookups)
        if [id(r) for r in drafting] == [id(r) for r in requests]:
            return _Round(requests, proposal, lengths)
        position = {id(r): i for i, r in enumerate(requests)}
        rows = torch.tensor([position[id(r)] for r in drafting])  # [D] each drafting row's place in the round
        widened = proposal.widen(rows, len(requests))
        drafted = torch.zeros(len(requests), dtype=torch.bool).index_fill_(0, rows, True)
        lengths = torch.zeros(len(requests), dtype=lengths.dtype).index_copy_(0, rows, lengths)
        return _Round(requests, widened, lengths, drafted)

    def _max_length(self, request: Request) -> int:
        # a round commits at most (verified + 1) tokens: never verify past max_tokens
        return max(min(self.block_size, request.remaining - 1), 0)

    def _max_lengths(self, requests: list[Request], lookups: dict[int, LookupChoice] | None = None) -> torch.Tensor:
        """[B] draft tokens each row may verify; a lookup row (``lookups``: by ``id`` of its request) no more
        than its draft."""
        lookups = lookups or {}
        return torch.tensor([min(self._max_length(r), len(lookups[id(r)].tokens)) if id(r) in lookups
                             else self._max_length(r) for r in requests])

    def _schedule_verify(self, requests: list[Request], proposal: DraftProposal,
                         lookups: dict[int, LookupChoice] | None = None) -> torch.Tensor:
        caps = self._max_lengths(requests, lookups)
        full = schedule_full(self.block_size, caps)
        if self.config.scheduler != "confidence":
            return full
        # [B] seeded sampled rows: each trimmed on its own by the fixed cost model (engine.pinned_token_cost)
        pinned = torch.tensor([r.params.pinned for r in requests])
        alone = schedule_alone(proposal.confidences, self.config.pinned_token_cost, caps)
        return torch.where(pinned, alone, schedule_prefix(proposal.confidences, self.profile, caps))

    def _verify_batch(self, round_: _Round) -> VerifyBatch:
        """The target's inputs: each row's uncached committed tokens, then its scheduled draft prefix."""
        requests, lengths = round_.requests, round_.lengths
        block = self.block_size if round_.proposal is not None else 0  # prefill / plain rounds verify nothing
        uncached = [r.num_uncached for r in requests]
        num_new = [u + n for u, n in zip(uncached, lengths.tolist())]
        starts = [r.num_cached for r in requests]
        meta = self.allocator.metadata([r.request_id for r in requests], starts, num_new, causal=True)
        q_max = max(num_new)
        input_ids = torch.zeros(len(requests), q_max, dtype=torch.long)
        draft_tokens = (round_.proposal.tokens if round_.proposal is not None
                        else torch.zeros(len(requests), block, dtype=torch.long))
        for b, r in enumerate(requests):
            input_ids[b, : uncached[b]] = torch.tensor(r.tokens[r.num_cached:])
        idx = torch.arange(q_max)[None, :]
        u = torch.tensor(uncached)[:, None]
        draft_index = (idx - u).clamp(0, max(block - 1, 0))
        if block:
            input_ids = torch.where((idx >= u) & (idx < torch.tensor(num_new)[:, None]),
                                    draft_tokens.gather(1, draft_index), input_ids)
        sampling = self._sampling(requests)
        greedy = bool(sampling.greedy.all())
        return VerifyBatch(
            input_ids=input_ids,
            positions=torch.tensor(starts)[:, None] + idx,
            meta=meta,
            logits_at=(u - 1 + torch.arange(block + 1)[None, :]).clamp(max=q_max - 1),
            num_uncached=u[:, 0],
            draft_tokens=draft_tokens,
            num_draft=lengths,
            draft_probs=None if round_.proposal is None or greedy else round_.proposal.draft_probs,
            sampling=SamplingTensors(sampling.temperature, sampling.top_p, sampling.top_k, []),
            uniforms=sampling.uniforms(block + 2, None if round_.drafted is None else (~round_.drafted).tolist()),
            want_features=torch.tensor([r.speculative and self.drafter is not None for r in requests]),
            all_greedy=greedy,
        )

    def _commit(self, round_: _Round, output: VerifyOutput) -> None:
        result = output.result
        tokens_rows = result.tokens.tolist()
        accepted_rows = result.num_accepted.tolist()
        kept_rows = output.kept.tolist()
        lengths = round_.lengths.tolist()
        has_block = ([round_.proposal is not None] * len(lengths) if round_.drafted is None
                     else round_.drafted.tolist())  # rows that verified a drafted block (held-back rows did not)
        want = [r.speculative and self.drafter is not None for r in round_.requests]
        if any(want):
            self.drafter.commit([r.request_id for r, w in zip(round_.requests, want) if w],
                                [k for k, w in zip(kept_rows, want) if w],
                                output.packed_features(torch.tensor(want)))
        for b, request in enumerate(round_.requests):
            if request.status == Status.FINISHED:  # aborted while in flight
                continue
            accepted = accepted_rows[b]
            request.num_cached += kept_rows[b]
            self.allocator.truncate(request.request_id, request.num_cached)
            new = tokens_rows[b][: accepted + 1]
            drafted, source = (self.block_size if has_block[b] else 0), "head"
            if has_block[b] and request.sources is not None:
                source = request.sources.source or "head"
                drafted = request.sources.drafted if source == "lookup" else drafted
                if lengths[b] > 0:  # a draft verified (as our proposer in vLLM counts them)
                    self.sources.record(request.sources, lengths[b], accepted, request.params.greedy)
            if has_block[b] and request.gate is not None and source == "head":
                batch = DraftGate.batch_of(len(round_.requests), request.params.pinned)
                self.gate.record(request.gate, accepted, batch, request.params.pinned)
                if request.params.greedy:
                    self.head_pool.observe(accepted)
            request.metrics.record_round(drafted, lengths[b], accepted, source)
            self.metrics.record_round(drafted, lengths[b], accepted, source)
            self._append(request, new)

    def _append(self, request: Request, new: list[int]) -> None:
        """Commit tokens, applying max_tokens, EOS and stop strings."""
        reason = None
        for i, token in enumerate(new):
            if not request.params.ignore_eos and token in self.eos_ids:
                new, reason = new[: i + 1], "stop"
                break
        if len(new) >= request.remaining:
            new = new[: request.remaining]
            reason = reason or "length"
        request.tokens.extend(new)
        request.new_tokens.extend(new)
        if request.sources is not None:
            self.sources.extend(request.sources, new)
        request.metrics.completion_tokens += len(new)
        self.metrics.completion_tokens += len(new)
        if request.params.stop and self.tokenizer is not None and reason != "stop":
            cut = self._stop_cut(request)
            if cut is not None:
                drop = len(request.output_ids) - cut
                if drop:
                    del request.tokens[-drop:]
                    del request.new_tokens[-drop:]
                reason = "stop"
        if reason is not None:
            self._finish(request, reason)

    def _stop_cut(self, request: Request) -> int | None:
        """Number of output tokens up to the one that completes a stop string, if any."""
        out = request.output_ids
        for n in range(max(len(out) - len(request.new_tokens), 1), len(out) + 1):
            text = self.tokenizer.decode(out[:n], skip_special_tokens=True)
            if any(s in text for s in request.params.stop):
                return n
        return None

    def _finish(self, request: Request, reason: str) -> None:
        request.status, request.finish_reason = Status.FINISHED, reason
        request.metrics.record_finished(request.metrics.completion_tokens, request.metrics.verify_steps)
        self.metrics.record_finished(request.metrics.completion_tokens, request.metrics.verify_steps)
        self.allocator.free(request.request_id)
        if self.drafter is not None and request.speculative:
            self.drafter.release(request)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def _emit(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = []
        for request in requests:
            finished = request.status == Status.FINISHED
            if request.new_tokens or finished:
                outputs.append(RequestOutput(request.request_id, request.new_tokens, finished, request.finish_reason))
                request.new_tokens = []
        return outputs

    # ------------------------------------------------------------------ conveniences
    def stream(self) -> Iterator[RequestOutput]:
        while self.has_unfinished():
            yield from self.step()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
        for _ in self.stream():
            pass
        return [self.result(i) for i in ids]

    def result(self, request_id: int) -> GenerationResult:
        r = self.requests.pop(request_id)
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True) if self.tokenizer else ""
        if r.params.stop:
            for s in r.params.stop:
                if s in text:
                    text = text[: text.index(s)]
        return GenerationResult(r.request_id, r.prompt_ids, r.output_ids, text, r.finish_reason or "", r.metrics)

    def measure_profile(self) -> StepCostProfile:
        """Profile verify cost against batch tokens on this machine (the scheduler's SPS table)."""
        cap = min(self.config.profile_max_tokens, self.config.max_num_seqs * (self.block_size + 1))
        counts = sorted({1, *[2**i for i in range(1, 16) if 2**i <= cap], cap})
        alloc, sid = self.allocator, -1
        alloc.reserve(sid, cap + 64)

        def run(n: int) -> None:
            alloc.truncate(sid, 64)
            meta = alloc.metadata([sid], [64], [n])
            self.target.forward(torch.zeros(1, n, dtype=torch.long), 64 + torch.arange(n)[None], meta)

        try:
            alloc.grow(sid, 64)
            draft = getattr(self.drafter, "round_seconds", None)
            profile = StepCostProfile.measure(run, counts)
            if draft is not None:
                profile = StepCostProfile(profile.token_counts, profile.seconds, draft())
        finally:
            alloc.free(sid)
        return profile
