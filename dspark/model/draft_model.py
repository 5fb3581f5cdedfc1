"""The DSpark draft head.

Parallel stage: the fused target features (``fc`` + ``hidden_norm``) are the keys/values of
the context; the block (anchor + gamma-1 mask tokens, embedded with the target's embedding)
gives the queries; one bidirectional pass yields gamma hidden states and base logits through
the target's LM head. Sequential stage: a low-rank Markov head adds ``W1[x_{k-1}] @ W2`` to
position k's logits and tokens are sampled left to right; the confidence head estimates
``P(token k survives | tokens < k survived)`` from ``[h_k; W1[x_{k-1}]]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.config import DraftConfig
from dspark.decoding.kv_cache import AttentionMetadata, PagedKVCache
from dspark.decoding.sampling import SamplingTensors, logits_to_probs, sample_from
from dspark.model.layers import DecoderLayer, Linear, RMSNorm


@dataclass
class DraftProposal:
    """What a drafter hands to the scheduler and the verifier."""

    tokens: torch.Tensor  # [B, G] int64 drafted tokens
    draft_probs: torch.Tensor | None  # [B, G, V] the exact distributions sampled from (None: greedy, not sent)
    confidences: torch.Tensor  # [B, G] calibrated P(token k accepted | tokens < k accepted)

    def rows(self, keep: list[int]) -> DraftProposal:
        """Rows ``keep`` of the proposal (requests that finished while their block was drafted drop out)."""
        if len(keep) == len(self.tokens):
            return self
        index = torch.tensor(keep, dtype=torch.long)
        probs = None if self.draft_probs is None else self.draft_probs.to_dense().index_select(0, index)
        return DraftProposal(self.tokens[index], probs, self.confidences[index])

    def widen(self, rows: torch.Tensor, total: int) -> DraftProposal:
        """This proposal as rows ``rows`` [n] of a ``total``-row one, zeros elsewhere (rows without a block)."""
        def widen(t: torch.Tensor | None) -> torch.Tensor | None:  # [n, ...] -> [total, ...]
            if t is None:
                return None
            t = t.to_dense()
            return t.new_zeros(total, *t.shape[1:]).index_copy_(0, rows, t)

        return DraftProposal(widen(self.tokens), widen(self.draft_probs), widen(self.confidences))


class MarkovHead(nn.Module):
    """The sequential stage's logit bias from the previous token, as speculators defines it.

    ``vanilla``: B(x_{k-1}, .) = W2 e_k with e_k = W1[x_{k-1}] (low-rank first-order transitions).
    ``gated``: W2 (g_k * e_k), g_k = sigmoid(gate_proj([h_k; e_k])).
    ``rnn``: a gated recurrence over the block, state s_0 = 0:
    [a, c, o] = joint_proj([s_{k-1}; e_k; h_k]), s_k = sigmoid(a) s_{k-1} + (1 - sigmoid(a)) tanh(c), bias W2 tanh(o).
    W1 is indexed by target token ids; W2 maps to the draft's output vocabulary (reduced or full).
    """

    def __init__(self, vocab_size: int, rank: int, output_vocab_size: int | None = None, kind: str = "vanilla",
                 hidden_size: int = 0):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, output_vocab_size or vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the plain parallel drafter
        if kind == "gated":
            self.gate_proj = Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = Linear(2 * rank + hidden_size, 3 * rank)

    def step(
        self,
        embedding: torch.Tensor,  # [..., r] W1[x_{k-1}]
        hidden: torch.Tensor,  # [..., hidden] h_k
        state: torch.Tensor | None,  # [..., r] the rnn state before position k (None: zeros)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # the vector W2 reads [..., r], the state after position k
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat((hidden.to(embedding.dtype), embedding), dim=-1)))
            return gate * embedding, None
        if self.kind == "rnn":
            state = torch.zeros_like(embedding) if state is None else state
            a, c, o = self.joint_proj(torch.cat((state, embedding, hidden.to(embedding.dtype)), dim=-1)).chunk(3, -1)
            keep = torch.sigmoid(a)
            return torch.tanh(o), keep * state + (1 - keep) * torch.tanh(c)
        return embedding, None

    def block(
        self,
        embedding: torch.Tensor,  # [..., G, r] teacher-forced W1[x_{k-1}] at every block position
        hidden: torch.Tensor,  # [..., G, hidden]
    ) -> torch.Tensor:  # [..., G, r] the vectors W2 reads
        if self.kind != "rnn":
            return self.step(embedding, hidden, None)[0]
        state, out = None, []
        for k in range(embedding.shape[-2]):
            mixed, state = self.step(embedding[..., k, :], hidden[..., k, :], state)
            out.append(mixed)
        return torch.stack(out, dim=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = Linear(in_features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [..., in_features] -> logit [...]
        return self.proj(features)[..., 0]


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        bb = cfg.backbone
        self.fc = Linear(cfg.num_feature_layers * cfg.target_hidden_size, bb.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(bb.hidden_size, bb.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(bb) for _ in range(bb.num_layers))
        self.norm = RMSNorm(bb.hidden_size, bb.rms_norm_eps)
        out_vocab = cfg.output_vocab_size
        self.markov_head = (MarkovHead(bb.vocab_size, cfg.markov_rank, out_vocab, cfg.markov_head_type, bb.hidden_size)
                            if cfg.enable_markov_head else None)
        conf_in = bb.hidden_size + (cfg.markov_rank if cfg.confidence_reads_markov else 0)
        self.confidence_head = ConfidenceHead(conf_in) if cfg.enable_confidence_head else None
        temps = cfg.confidence_temperatures or (1.0,) * cfg.block_size
        self.register_buffer("confidence_temperatures", torch.tensor(temps), persistent=False)
        # The draft's own embedding / LM head, when its checkpoint ships them (a reduced vocabulary must ship its
        # LM head: the target's covers the full vocabulary); otherwise the target's are shared.
        self.own = nn.ModuleDict()
        if cfg.reduced_vocab:
            self.own["lm_head"] = Linear(bb.hidden_size, out_vocab, bias=False)
            # speculators' d2t: target id = draft id + d2t[draft id]; t2d: which target ids the draft can emit
            self.register_buffer("d2t", torch.zeros(out_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(bb.vocab_size, dtype=torch.bool))
        self._shared: dict[str, nn.Module] = {}  # target embedding and LM head: never parameters of ours

    def add_own(self, name: str) -> None:
        """Give the draft its own ``embed_tokens`` or ``lm_head`` (a checkpoint that ships one)."""
        bb = self.config.backbone
        if name == "embed_tokens":
            self.own[name] = nn.Embedding(bb.vocab_size, bb.hidden_size)
        elif name == "lm_head":
            self.own[name] = Linear(bb.hidden_size, self.config.output_vocab_size, bias=False)
        else:
            raise ValueError(name)

    def bind_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear, *, head_in_draft_dtype: bool = False
                    ) -> DSparkDraft:
        """Share the target's (frozen) embedding and LM head (the draft's own ones, if any, take precedence).

        ``head_in_draft_dtype``: draft with a copy of the LM head in the draft's dtype where the target's differs
        (serving: a bf16 draft beside an fp32 target, on a CPU with native bf16, runs the block's LM head 5-8x
        faster, docs/performance.md; the target verifies every token, so outputs are unchanged). Training keeps
        the shared tensor: a copy of a Kimi-sized head costs GBs."""
        if embed_tokens.weight.shape[1] != self.config.backbone.hidden_size:
            raise ValueError(
                f"target hidden size {embed_tokens.weight.shape[1]} != draft hidden size "
                f"{self.config.backbone.hidden_size}"
            )
        dtype = self.fc.weight.dtype
        if head_in_draft_dtype and (lm_head.weight.dtype != dtype or not isinstance(lm_head, Linear)):
            # serving: the batch-invariant ``Linear`` (a row's logits do not depend on the rows drafted beside it),
            # over the same weight where the dtypes agree
            weight = lm_head.weight.detach().to(dtype)
            lm_head = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            lm_head.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self._shared = {"embed_tokens": embed_tokens, "lm_head": lm_head}
        return self

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.own["embed_tokens"] if "embed_tokens" in self.own else self._shared["embed_tokens"]

    @property
    def lm_head(self) -> nn.Linear:
        return self.own["lm_head"] if "lm_head" in self.own else self._shared["lm_head"]

    def block_inputs(
        self,
        anchors: torch.Tensor,  # [B] last committed token of each sequence
        anchor_positions: torch.Tensor,  # [B] its position
        num_tokens: int,  # gamma: tokens to draft (<= config.block_size)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # block ids [B, S], positions [B, S]; S = num_tokens (+1, see layout)
        """The block fed to ``backbone``: the anchor, then mask tokens, in the checkpoint's layout."""
        slots = num_tokens + self.config.first_prediction_slot
        offsets = torch.arange(slots, device=anchors.device)
        block_ids = torch.full((len(anchors), slots), self.config.mask_token_id, device=anchors.device)
        block_ids[:, 0] = anchors
        return block_ids, anchor_positions[:, None] + offsets[None, :]

    def predicting(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, S, hidden] from ``backbone`` -> [B, gamma, hidden]: the slots predicting tokens 1..gamma
        return hidden[:, self.config.first_prediction_slot:]

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [...] draft-vocabulary ids -> target ids
        return ids + self.d2t[ids] if self.config.reduced_vocab else ids

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        # probs: [..., V_draft] -> [..., V] (zero on target ids outside the draft vocabulary)
        if not self.config.reduced_vocab:
            return probs
        columns = torch.arange(probs.shape[-1], device=probs.device) + self.d2t
        out = probs.new_zeros(*probs.shape[:-1], self.config.backbone.vocab_size)
        return out.index_copy_(-1, columns, probs)

    def make_cache(self, num_tokens: int, block_size: int) -> PagedKVCache:
        bb = self.config.backbone  # MLA drafts cache the latent only, like MLA targets
        return PagedKVCache(bb.num_layers, num_tokens, block_size, *bb.cache_geometry, self.fc.weight.dtype,
                            self.fc.weight.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        # features: [..., K * target_hidden] -> [..., hidden]
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def backbone(
        self,
        block_ids: torch.Tensor,  # [B, G] anchor followed by mask tokens
        block_positions: torch.Tensor,  # [B, G]
        context: torch.Tensor,  # [B, C, hidden] fused features of new context positions (C may be 0)
        context_positions: torch.Tensor,  # [B, C]
        cache: PagedKVCache | None,  # the context keys/values of earlier rounds
        meta: AttentionMetadata | None,  # writes of the new context, reads of all context
        context_valid: torch.Tensor | None = None,  # [B, C] bool, no-cache path: context visible to row b
    ) -> torch.Tensor:  # [B, G, hidden]
        """One parallel pass over the block; new context keys/values are added to the cache.

        Without a cache (training), ``context`` may have batch 1 and be shared by all B blocks,
        each seeing only its own prefix through ``context_valid``.
        """
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        batch, block = block_ids.shape
        bb = self.config.backbone
        block_mask = torch.ones(batch, block, block, dtype=torch.bool, device=x.device)
        window_masks = None
        if bb.is_sliding(None):  # sliding layers: a window over context and block, causal inside the block
            key_positions = (context_positions.expand(batch, -1) if cache is None
                             else torch.arange(meta.read_slots.shape[1], device=x.device)[None].expand(batch, -1))
            ctx_window = self._window(block_positions, key_positions)
            window_masks = (ctx_window, self._window(block_positions, block_positions)
                            & (block_positions[:, None, :] <= block_positions[:, :, None]))
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.project_q(h, block_positions)
            k_block, v_block = attn.project_kv(h, block_positions)
            if cache is None:  # training: the whole context is passed in every time
                k_ctx, v_ctx = attn.project_kv(context, context_positions)
                k_ctx, v_ctx = k_ctx.expand(batch, -1, -1, -1), v_ctx.expand(batch, -1, -1, -1)
                ctx_valid = (context_valid if context_valid is not None
                             else torch.ones(batch, context.shape[1], dtype=torch.bool, device=x.device))
            else:
                if context.shape[1]:
                    k_new, v_new = attn.cache_kv(context, context_positions)
                    cache.write(index, meta.write_slots, k_new, v_new)
                k_ctx, v_ctx = attn.expand_cached(*cache.gather(index, meta.read_slots))
                ctx_valid = meta.key_valid
            # the block's keys first, then the context's (padded to the batch's longest): each row then sees its
            # keys at the same places whatever the batch, so the chunked bf16 attention sums them in the same order
            # (attention does not depend on the order of its keys; the rounding of a sum does)
            keys = torch.cat((k_block, k_ctx.to(k_block.dtype)), dim=1)
            values = torch.cat((v_block, v_ctx.to(v_block.dtype)), dim=1)
            ctx_mask = ctx_valid[:, None, :].expand(-1, block, -1)
            own_mask = block_mask
            if window_masks is not None and bb.is_sliding(index):
                ctx_mask, own_mask = ctx_mask & window_masks[0], window_masks[1]
            mask = torch.cat((own_mask, ctx_mask), dim=-1)
            x = x + attn.attend(q, keys, values, mask)
            x = layer.feed_forward(x)
        return self.norm(x)

    def _window(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        # query_positions: [B, Q], key_positions: [B, K] -> [B, Q, K] bool: key within the sliding window
        distance = query_positions[:, :, None] - key_positions[:, None, :]
        return distance < self.config.backbone.sliding_window

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., hidden] -> [..., V] float32
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()

    def position_logits(
        self,
        base_logits: torch.Tensor,  # [..., V]
        hidden: torch.Tensor,  # [..., hidden]
        prev_tokens: torch.Tensor,  # [...] token before each position (anchor for position 1), target ids
        position: torch.Tensor | int | slice,  # 0-based block position(s) for the calibration temperature
        candidates: torch.Tensor | None = None,  # [..., C] vocabulary ids of base_logits (None: all V)
        state: torch.Tensor | None = None,  # [..., r] rnn head: the state before this position
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # logits [..., V or C], confidence logit [...], state
        """The sequential stage at one position (``state`` carried by the caller), or teacher-forced over a whole
        block when ``position`` is a slice (training: ``[..., G, ...]`` inputs)."""
        logits, embedding = base_logits, None
        if self.markov_head is not None:
            embedding = self.markov_head.markov_w1(prev_tokens)  # [..., r]
            if isinstance(position, slice):
                mixed = self.markov_head.block(embedding, hidden)
            else:
                mixed, state = self.markov_head.step(embedding, hidden, state)
            if candidates is None:
                bias = self.markov_head.markov_w2(mixed)
            else:  # the bias of the candidate tokens only: W2 rows gathered, not the whole vocabulary
                w2 = self.markov_head.markov_w2.weight[candidates]  # [..., C, r]
                bias = (w2 @ mixed[..., None])[..., 0]
            logits = base_logits + bias.float()
        if self.confidence_head is None:
            return logits, logits.new_full(logits.shape[:-1], 30.0), state
        # the confidence head reads the raw W1[x_{k-1}] for every Markov head type (speculators, vLLM, SGLang)
        features = torch.cat((hidden, embedding), dim=-1) if self.config.confidence_reads_markov else hidden
        conf_logit = self.confidence_head(features).float() / self.confidence_temperatures[position]
        return logits, conf_logit, state

    @torch.inference_mode()
    def propose(
        self,
        hidden: torch.Tensor,  # [B, G, hidden] from ``backbone``
        anchors: torch.Tensor,  # [B] last committed token of each sequence
        sampling: SamplingTensors,  # B rows
        prefilter_k: int,
    ) -> DraftProposal:
        """Sample the block left to right, each token conditioned on the one before it.

        With ``prefilter_k`` the Markov bias is added to the top ``4 * prefilter_k`` base logits and
        the token is drawn among the top ``prefilter_k`` of those; ``draft_probs`` is exactly the
        distribution drawn from either way (zero outside the candidates), or None when every row is
        greedy (verification then reads the tokens only).

        The pass is cheap where it can be: the candidates are picked on the LM head's own output (its dtype,
        the same values as in float32), only they become float32, and the dense distributions are written once
        for the whole block, not per position.
        """
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))  # [B, G, V] in the head's dtype
        vocab = logits.shape[-1]
        candidates = None
        if 0 < prefilter_k < vocab:
            logits, candidates = logits.topk(min(vocab, 4 * prefilter_k), dim=-1)  # [B, G, C]
        base = logits.float()  # [B, G, V or C]
        # decided on the host when the parameters are there (as logits_to_probs does); on a device: built anyway
        greedy_only = bool(sampling.greedy.all()) if sampling.temperature.device.type == "cpu" else False
        tokens, probs, confidences = [], [], []
        prev, state = anchors, None
        # a batch of greedy rows draws nothing: each token is its position's argmax, which is what the one-point
        # distribution of ``logits_to_probs`` and ``sample_from`` give a greedy row (the first index among equal
        # maxima), without the truncation and the inverse-CDF draw a sampled row needs at every position
        uniforms = None if greedy_only else sampling.uniforms(hidden.shape[1])  # [B, G]
        for k in range(hidden.shape[1]):
            cand = None if candidates is None else candidates[:, k]
            logits_k, conf_logit, state = self.position_logits(base[:, k], hidden[:, k], prev, k, cand, state)
            if greedy_only:
                choice = logits_k.argmax(-1)  # [B]
                local_probs = None
            else:
                local_probs = logits_to_probs(logits_k, sampling, prefilter_k)  # [B, V or C]
                choice = sample_from(local_probs, uniforms[:, k])
            prev = choice if cand is None else cand.gather(1, choice[:, None])[:, 0]
            prev = self.to_target_ids(prev)  # the Markov head's W1 and the verifier read target ids
            tokens.append(prev)
            probs.append(local_probs)
            confidences.append(torch.sigmoid(conf_logit))
        draft_probs = None
        if not greedy_only:
            draft_probs = torch.stack(probs, 1)  # [B, G, V or C]
            if candidates is not None:
                draft_probs = draft_probs.new_zeros(*draft_probs.shape[:2], vocab).scatter_(-1, candidates,
                                                                                           draft_probs)
            draft_probs = self.to_target_probs(draft_probs)  # [B, G, V]
        return DraftProposal(torch.stack(tokens, 1), draft_probs, torch.stack(confidences, 1))
