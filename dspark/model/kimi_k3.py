"""Kimi-K3 (``model_type: kimi_k3``): the target of the seeds, as vLLM 0.32 reads it.

``KimiK3ForConditionalGeneration`` (``vllm/models/kimi_k3/``, config ``vllm/transformers_utils/configs/kimi_k3.py``)
wraps a vision tower and a ``kimi_linear`` text model under ``text_config``
(``vllm/transformers_utils/configs/kimi_linear.py``): a hybrid of KDA linear-attention layers (Kimi Delta Attention,
a fixed recurrent state per sequence instead of a KV cache) and MLA layers without rotary embeddings (NoPE, with a
sigmoid output gate), a latent mixture of experts, and block Attention Residuals. The native engine of this project
implements none of KDA, NoPE-gated MLA, latent experts or attention residuals, so it does not run this target:
vLLM does (``vllm serve --trust-remote-code``). This module reads the config for sizing and for checking drafts
against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.config import ConfigError

MODEL_TYPES = ("kimi_k3", "kimi_linear")
NATIVE_REFUSAL = ("Kimi-K3 (KDA linear attention + NoPE MLA + latent MoE + attention residuals) is not implemented "
                  "by this project's native engine; vLLM serves it (vllm serve --trust-remote-code), see "
                  "docs/deploy.md")


@dataclass(frozen=True)
class KimiK3Config:
    hidden_size: int
    vocab_size: int
    num_layers: int
    kda_layers: tuple[int, ...]  # 1-based, as linear_attn_config["kda_layers"]; every other layer is MLA
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    num_heads: int  # MLA
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool
    intermediate_size: int  # dense layers
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_expert_hidden_size: int  # latent experts: 0 = experts in the full hidden size
    first_k_dense_replace: int
    attn_res_block_size: int  # 0 = plain residual stream

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> KimiK3Config:
        text = data.get("text_config", data) if data.get("model_type") == "kimi_k3" else data
        linear = text.get("linear_attn_config") or {}

        def need(source: dict, key: str, where: str) -> Any:
            if source.get(key) is None:
                raise ConfigError(f"{where}{key}", "missing from the Kimi-K3 config")
            return source[key]

        t, la = "text_config.", "text_config.linear_attn_config."
        return cls(
            hidden_size=int(need(text, "hidden_size", t)), vocab_size=int(need(text, "vocab_size", t)),
            num_layers=int(need(text, "num_hidden_layers", t)),
            kda_layers=tuple(int(i) for i in need(linear, "kda_layers", la)),
            kda_heads=int(need(linear, "num_heads", la)), kda_head_dim=int(need(linear, "head_dim", la)),
            conv_kernel=int(linear.get("short_conv_kernel_size", 4)),
            num_heads=int(need(text, "num_attention_heads", t)), q_lora_rank=int(text.get("q_lora_rank") or 0),
            kv_lora_rank=int(need(text, "kv_lora_rank", t)), qk_nope_head_dim=int(need(text, "qk_nope_head_dim", t)),
            qk_rope_head_dim=int(need(text, "qk_rope_head_dim", t)), v_head_dim=int(need(text, "v_head_dim", t)),
            mla_output_gate=bool(text.get("mla_use_output_gate", False)),
            intermediate_size=int(need(text, "intermediate_size", t)),
            num_experts=int(text.get("num_experts") or 0),
            num_experts_per_token=int(text.get("num_experts_per_token") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            num_shared_experts=int(text.get("num_shared_experts") or 0),
            routed_expert_hidden_size=int(text.get("routed_expert_hidden_size") or 0),
            first_k_dense_replace=int(text.get("first_k_dense_replace") or 0),
            attn_res_block_size=int(text.get("attn_res_block_size") or 0),
        )

    def is_kda(self, index: int) -> bool:
        """0-based layer ``index`` is a KDA layer (vLLM: ``(index + 1) in kda_layers``)."""
        return index + 1 in self.kda_layers

    @property
    def num_mla_layers(self) -> int:
        return sum(not self.is_kda(i) for i in range(self.num_layers))

    # -- sizing (parameter counts follow vllm/models/kimi_k3/nvidia/{kda,mla,model}.py) --
    def _kda_params(self) -> tuple[float, float]:
        """(replicated, split by tensor parallelism) parameters of one KDA layer."""
        h, proj = self.hidden_size, self.kda_heads * self.kda_head_dim
        in_proj = h * (4 * proj + self.kda_head_dim + self.kda_heads)  # q, k, v, g; f_a; beta
        gate = self.kda_head_dim * proj  # f_b_proj (full-rank gate)
        conv = 3 * proj * self.conv_kernel
        o = proj * h + self.kda_head_dim  # o_proj, o_norm
        return 0.0, in_proj + gate + conv + o + 2 * self.kda_heads * self.kda_head_dim

    def _mla_params(self) -> tuple[float, float]:
        h, qk = self.hidden_size, self.qk_nope_head_dim + self.qk_rope_head_dim
        q_a = h * self.q_lora_rank + self.q_lora_rank if self.q_lora_rank else 0
        q_b = (self.q_lora_rank or h) * self.num_heads * qk
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        gate = h * self.num_heads * self.v_head_dim if self.mla_output_gate else 0
        o = self.num_heads * self.v_head_dim * h
        return q_a + kv_a, q_b + kv_b + gate + o

    def layer_shapes(self) -> list[tuple[float, float, int, float, float]]:
        """Per layer, for sizing: (replicated params, params split by tensor parallelism, routed experts,
        params per routed expert, other FFN params split by tensor parallelism)."""
        h = self.hidden_size
        latent = self.routed_expert_hidden_size or h
        shapes = []
        for index in range(self.num_layers):
            rep, split = self._kda_params() if self.is_kda(index) else self._mla_params()
            rep += 2 * h + (4 * h if self.attn_res_block_size else 0)  # norms; attention-residual norms/projections
            if self.num_experts and index >= self.first_k_dense_replace:
                rep += self.num_experts * h + self.num_experts  # router and its bias
                shared = 3 * h * self.moe_intermediate_size * self.num_shared_experts
                latent_proj = 2 * h * latent if self.routed_expert_hidden_size else 0  # down / up to the latent
                shapes.append((rep, split, self.num_experts, 3 * latent * self.moe_intermediate_size,
                               shared + latent_proj))
            else:
                shapes.append((rep, split, 0, 0.0, 3 * h * self.intermediate_size))
        return shapes

    def kv_bytes_per_token(self, kv_bytes: float = 2.0) -> float:
        """MLA layers only: one (kv_lora_rank + rope dims) latent per token, replicated on every rank."""
        return self.num_mla_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_bytes

    def state_bytes_per_sequence(self, speculative_tokens: int, conv_bytes: float = 2.0,
                                 state_bytes: float = 4.0) -> float:
        """KDA layers: a fixed state per sequence (vLLM mamba_utils: conv state 3*H*d*(K-1+spec) in the model dtype,
        recurrent state H*d*d in fp32), split by tensor parallelism."""
        proj = self.kda_heads * self.kda_head_dim
        per_layer = (3 * proj * (self.conv_kernel - 1 + speculative_tokens) * conv_bytes
                     + self.kda_heads * self.kda_head_dim ** 2 * state_bytes)
        return (self.num_layers - self.num_mla_layers) * per_layer
