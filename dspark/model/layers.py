"""Building blocks shared by the target model and the DSpark draft backbone.

Attention modules expose three steps so that callers decide where keys and values come
from (the paged cache for the target; cached context features plus the block for the draft):
``project_q``, ``project_kv`` and ``attend``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F
from torch import nn

from dspark.config import DecoderConfig, RopeConfig
from dspark.model.attention import attend

_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_invariant", default=True)


@contextlib.contextmanager
def shape_variant_kernels():
    """Inside, ``Linear`` calls the fastest kernel for every shape (a pass whose rows never meet a decode, such as
    the training teacher's, needs no batch invariance)."""
    token = _INVARIANT.set(False)
    try:
        yield
    finally:
        _INVARIANT.reset(token)


class Linear(nn.Linear):
    """``nn.Linear`` that gives a row the same bf16/fp16 result on the CPU whatever the batch shape.

    oneDNN runs a single row through a GEMV kernel and two or more rows through a GEMM kernel; the
    two round differently (measured on SmolLM2's ``down_proj``: 2 of 8 rows differ), so a position
    decoded alone would get other logits than the same position verified inside a block. A single
    row therefore runs as two. The GEMM's per-row result does not depend on the number of rows up to
    ``ROWS``; above it, oneDNN's AMX kernels (measured on an Intel Sapphire Rapids: every shape of
    SmolLM2, from 33 rows on) round a row differently, so larger inputs run ``ROWS`` rows at a time.
    """

    ROWS = 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16) or not _INVARIANT.get():
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        if 1 < len(rows) <= self.ROWS:
            return F.linear(x, self.weight, self.bias)
        out = [F.linear(part if len(part) > 1 else part.expand(2, -1), self.weight, self.bias)[: len(part)]
               for part in rows.split(self.ROWS)]  # a lone row runs as two: no copy, still the GEMM path
        return torch.cat(out).reshape(*x.shape[:-1], -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _yarn_find_dim(num_rot: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rot * 2 * math.pi))) / (2 * math.log(base))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed on the fly for arbitrary position tensors."""

    def __init__(self, dim: int, rope: RopeConfig):
        super().__init__()
        # computed here, not read from a checkpoint: made on the CPU even when the model is built on "meta"
        inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
        self.attention_scaling = 1.0
        if rope.scaling_type == "linear":
            inv_freq = inv_freq / rope.factor
        elif rope.scaling_type == "llama3":
            low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
            high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
            smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
            is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv_freq = torch.where(is_mid, mid, scaled)
        elif rope.scaling_type == "yarn":
            max_pos = rope.original_max_position_embeddings
            low = max(math.floor(_yarn_find_dim(rope.beta_fast, dim, rope.theta, max_pos)), 0)
            high = min(math.ceil(_yarn_find_dim(rope.beta_slow, dim, rope.theta, max_pos)), dim - 1)
            ramp = (torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / max(high - low, 1e-3)
            extrapolation = 1 - ramp.clamp(0, 1)
            inv_freq = inv_freq / rope.factor * (1 - extrapolation) + inv_freq * extrapolation
            self.attention_scaling = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(
                rope.factor, rope.mscale_all_dim
            ) if rope.mscale_all_dim else yarn_mscale(rope.factor, rope.mscale)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] int64 -> cos, sin: [B, T, dim]
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    # x: [B, T, H, D]; cos/sin: [B, T, D]  (rotate-half convention of Hugging Face)
    # interleaved: rotary pairs are (x0, x1), (x2, x3), ... (DeepSeek); de-interleave first (evens, then odds)
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MoEGate(nn.Module):
    """DeepSeek-V3 routing: sigmoid scores, bias-corrected grouped top-k, normalised and scaled weights."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, hidden] -> weights [N, k] float32, expert ids [N, k]
        cfg, n = self.cfg, x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        per_group = cfg.n_routed_experts // cfg.n_group
        group_scores = choice.view(n, cfg.n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
        groups = group_scores.topk(cfg.topk_group, dim=-1).indices  # [N, topk_group]
        allowed = torch.zeros(n, cfg.n_group, dtype=torch.bool, device=x.device).scatter_(1, groups, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
        experts = choice.topk(cfg.num_experts_per_tok, dim=-1).indices  # [N, k]
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts


class MoE(nn.Module):
    """Routed experts plus shared experts (names as in DeepSeek / Kimi checkpoints)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate = MoEGate(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self.local_experts = set(range(cfg.n_routed_experts))  # expert parallelism keeps a subset per rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden]
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        out = torch.zeros_like(flat)
        for expert in experts.unique().tolist():  # dispatch: each expert runs once on its tokens
            if expert not in self.local_experts:
                continue
            token, slot = (experts == expert).nonzero(as_tuple=True)
            contribution = self.experts[expert](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, contribution.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAAttention(nn.Module):
    """Grouped-query attention (Llama / Qwen2 / Qwen3; optional per-head q/k RMSNorm)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(self.head_dim, cfg.rope)
        self.interleave = cfg.rope_interleave  # vLLM's is_neox_style false
        self.scale = self.head_dim**-0.5

    def project_q(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # h: [B, T, hidden], positions: [B, T] -> [B, T, H, D]
        q = self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        cos, sin = self.rotary(positions, q.dtype)
        return apply_rotary(q, cos, sin, self.interleave)

    def project_kv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # h: [B, T, hidden], positions: [B, T] -> k, v: [B, T, Hkv, D]
        k = self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = self.rotary(positions, k.dtype)
        return apply_rotary(k, cos, sin, self.interleave), v

    def attend(self, q, k, v, mask) -> torch.Tensor:
        return self.o_proj(attend(q, k, v, mask, self.scale))

    def cache_kv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.project_kv(h, positions)

    def expand_cached(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class MLAAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V3 / Kimi): low-rank q and a compressed kv latent.

    ``project_kv`` expands the latent to per-head keys and values; callers that cache the
    latent itself use ``compress_kv`` and ``expand_kv`` separately.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        hidden, qk_dim = cfg.hidden_size, cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * qk_dim, bias=False)
        else:
            self.q_proj = Linear(hidden, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=cfg.attention_bias)
        # DeepSeek YaRN (HF DeepseekV3, vLLM deepseek_scaling_rope.py + kimi_k3 mla.py): cos/sin carry
        # mscale(f, mscale) / mscale(f, mscale_all_dim) -- 1 only when the two are equal -- and the softmax scale
        # carries mscale(f, mscale_all_dim) squared
        self.rotary = RotaryEmbedding(self.rope_dim, cfg.rope)
        self.interleave = cfg.rope_interleave
        self.scale = qk_dim**-0.5
        if cfg.rope.scaling_type == "yarn" and cfg.rope.mscale_all_dim:
            self.scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2

    def project_q(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # h: [B, T, hidden] -> [B, T, H, nope + rope]
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        else:
            q = self.q_proj(h)
        q = q.unflatten(-1, (self.num_heads, self.nope + self.rope_dim))
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        cos, sin = self.rotary(positions, q.dtype)
        return torch.cat((q_nope, apply_rotary(q_rope, cos, sin, self.interleave)), dim=-1)

    def compress_kv(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # h: [B, T, hidden] -> latent: [B, T, kv_lora_rank + rope] (normalised latent, rotated rope key)
        latent, k_rope = self.kv_a_proj_with_mqa(h).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = self.rotary(positions, h.dtype)
        k_rope = apply_rotary(k_rope[:, :, None, :], cos, sin, self.interleave)[:, :, 0, :]
        return torch.cat((self.kv_a_layernorm(latent), k_rope), dim=-1)

    def expand_kv(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # latent: [B, L, kv_lora_rank + rope] -> k: [B, L, H, nope + rope], v: [B, L, H, v_dim]
        compressed, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(compressed).unflatten(-1, (self.num_heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope[:, :, None, :].expand(-1, -1, self.num_heads, -1)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def project_kv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.expand_kv(self.compress_kv(h, positions))

    def cache_kv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a target cache stores: the latent only ([B, T, 1, kv_lora_rank + rope], no values)."""
        latent = self.compress_kv(h, positions)[:, :, None, :]
        return latent, latent.new_zeros(*latent.shape[:3], 0)

    def expand_cached(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.expand_kv(k[:, :, 0, :])

    def attend(self, q, k, v, mask) -> torch.Tensor:
        return self.o_proj(attend(q, k, v, mask, self.scale))


def make_attention(cfg: DecoderConfig) -> nn.Module:
    return MLAAttention(cfg) if cfg.attention == "mla" else GQAAttention(cfg)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; where keys and values come from is decided by the caller."""

    def __init__(self, cfg: DecoderConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = make_attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.n_routed_experts > 0 and index >= cfg.first_k_dense_replace
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))
