"""Frozen configuration dataclasses of the core.

Everything inside ``dspark/`` takes these; the pydantic models in :mod:`dspark.schema`
validate user input at the boundary (YAML, HTTP, gRPC, CLI) and convert into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

AttentionKind = Literal["gqa", "mla"]


class ConfigError(ValueError):
    """A configuration or request value is invalid; the message names the field."""

    def __init__(self, field_name: str, message: str):
        self.field, self.message = field_name, message
        super().__init__(f"{field_name}: {message}")

    def __reduce__(self):  # crosses process boundaries (Ray actors) intact
        return ConfigError, (self.field, self.message)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding, optionally scaled (``llama3``, ``linear`` or ``yarn``)."""

    theta: float = 10000.0
    scaling_type: str | None = None
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @classmethod
    def from_hf(cls, theta: float, scaling: dict[str, Any] | None) -> RopeConfig:
        if not scaling:
            return cls(theta=theta)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            return cls(theta=theta)
        if kind not in ("linear", "llama3", "yarn"):
            raise ConfigError("rope_scaling.rope_type", f"unsupported rope scaling {kind!r}")
        known = {f.name for f in fields(cls)} - {"theta", "scaling_type"}
        kwargs = {k: v for k, v in scaling.items() if k in known and v is not None}
        return cls(theta=theta, scaling_type=kind, **kwargs)

    def to_hf(self) -> dict[str, Any] | None:
        if self.scaling_type is None:
            return None
        out: dict[str, Any] = {"rope_type": self.scaling_type, "factor": self.factor}
        if self.scaling_type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        if self.scaling_type == "yarn":
            out.update(
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                mscale=self.mscale,
                mscale_all_dim=self.mscale_all_dim,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """RoPE from either layout: ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        return RopeConfig.from_hf(theta, params)
    return RopeConfig.from_hf(hf.get("rope_theta", 10000.0), hf.get("rope_scaling"))


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of a stack of dense decoder layers: used by the target and by the draft backbone."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention: AttentionKind = "gqa"
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    # Multi-head latent attention (DeepSeek-V3 style); used when attention == "mla".
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary dims in (even, odd) pairs: DeepSeek MLA, or GQA with is_neox_style false
    # Mixture of experts (DeepSeek-V3 / Kimi): used when n_routed_experts > 0, from layer first_k_dense_replace on.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    model_type: str = "llama"
    # Per-layer attention kind (transformers' layer_types): "sliding_attention" layers see the last sliding_window
    # positions. In a DSpark draft such a layer is also causal inside the block, as vLLM runs it
    # (qwen3_dflash.py: _resolve_layer_attention); the native target engine does not implement windows.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.attention == "gqa":
            if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
                raise ConfigError(
                    "num_key_value_heads",
                    f"{self.num_kv_heads} must divide num_attention_heads {self.num_heads}",
                )
            if self.head_dim <= 0 or self.head_dim % 2:
                raise ConfigError("head_dim", f"must be a positive even number, got {self.head_dim}")
        elif self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ConfigError(name, "must be positive for MLA attention")
        else:
            raise ConfigError("attention", f"must be 'gqa' or 'mla', got {self.attention!r}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full_attention",
                                                                                     "sliding_attention"}:
                raise ConfigError("layer_types", f"needs {self.num_layers} entries of full_attention / "
                                                 f"sliding_attention, got {list(self.layer_types)}")
            if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
                raise ConfigError("sliding_window", "sliding_attention layers need a positive sliding_window")
        if self.n_routed_experts:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ConfigError("num_experts_per_tok", f"must be in [1, n_routed_experts={self.n_routed_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("moe_intermediate_size", "must be positive for a mixture of experts")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ConfigError("n_group", f"n_group {self.n_group} must divide n_routed_experts "
                                             f"{self.n_routed_experts} and topk_group must be in [1, n_group]")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Read a Hugging Face decoder config (llama, mistral, qwen2, qwen3, deepseek_v3 attention)."""
        model_type = hf.get("model_type", "llama")
        if model_type in ("kimi_k3", "kimi_linear"):
            from dspark.model.kimi_k3 import NATIVE_REFUSAL

            raise ConfigError("model_type", f"{model_type!r}: {NATIVE_REFUSAL}")
        known = ("llama", "mistral", "qwen2", "qwen3", "deepseek_v3", "kimi_k2")
        if model_type not in known:
            raise ConfigError("model_type", f"{model_type!r} is not supported (supported: {', '.join(known)})")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in hf:
                raise ConfigError(key, "missing from the model config")
        heads = hf["num_attention_heads"]
        mla = model_type in ("deepseek_v3", "kimi_k2") or "kv_lora_rank" in hf
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 4 * hf["hidden_size"]),
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(hf),
            attention="mla" if mla else "gqa",
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf.get("kv_lora_rank", 0) or 0,
            qk_nope_head_dim=hf.get("qk_nope_head_dim", 0) or 0,
            qk_rope_head_dim=hf.get("qk_rope_head_dim", 0) or 0,
            v_head_dim=hf.get("v_head_dim", 0) or 0,
            # rotary pairs (x0, x1), (x2, x3), ...: DeepSeek's rope_interleave (MLA), or vLLM's is_neox_style false
            # (GPT-J style) on a GQA draft; Hugging Face / neox rotate halves
            rope_interleave=(bool(hf.get("rope_interleave", model_type in ("deepseek_v3", "kimi_k2"))) if mla
                             else not bool(hf.get("is_neox_style", True))),
            n_routed_experts=hf.get("n_routed_experts") or 0,
            n_shared_experts=hf.get("n_shared_experts") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            first_k_dense_replace=hf.get("first_k_dense_replace", 0) or 0,
            model_type=model_type,
            layer_types=tuple(hf.get("layer_types") or ()),
            sliding_window=int(hf.get("sliding_window") or 0) if "sliding_attention" in (hf.get("layer_types") or ())
            else 0,
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face decoder config of this shape (``transformer_layer_config``)."""
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": self.rope.to_hf(),
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.attention == "gqa":
            out["is_neox_style"] = not self.rope_interleave
        if self.is_sliding(None):
            out.update(layer_types=list(self.layer_types), sliding_window=self.sliding_window)
        if self.attention == "mla":
            out.update(
                q_lora_rank=self.q_lora_rank,
                kv_lora_rank=self.kv_lora_rank,
                qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim,
                v_head_dim=self.v_head_dim,
                rope_interleave=self.rope_interleave,
            )
        if self.n_routed_experts:
            out.update(
                n_routed_experts=self.n_routed_experts, n_shared_experts=self.n_shared_experts,
                moe_intermediate_size=self.moe_intermediate_size, num_experts_per_tok=self.num_experts_per_tok,
                n_group=self.n_group, topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                norm_topk_prob=self.norm_topk_prob, first_k_dense_replace=self.first_k_dense_replace,
                scoring_func="sigmoid", topk_method="noaux_tc",
            )
        return out

    def is_sliding(self, layer: int | None) -> bool:
        """Layer ``layer`` (None: any layer) attends through a sliding window."""
        if layer is None:
            return "sliding_attention" in self.layer_types
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    @property
    def cache_geometry(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of one cached token and layer. GQA: keys and values per KV
        head. MLA: the compressed latent only (kv_lora_rank + rope dims), expanded when read."""
        if self.attention == "mla":
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim


@dataclass(frozen=True)
class DraftConfig:
    """A DSpark draft head: backbone shape plus the DSpark-specific parts."""

    backbone: DecoderConfig
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 7  # gamma: tokens drafted per round (on disk: speculative_tokens; see ``num_slots``)
    mask_token_id: int = 0
    markov_rank: int = 256
    enable_markov_head: bool = True  # on disk: markov_rank 0 when False (speculators' "no Markov head")
    markov_head_type: str = "vanilla"  # speculators' vanilla | gated | rnn (see draft_model.MarkovHead)
    enable_confidence_head: bool = True
    confidence_with_markov: bool = True  # the confidence head also reads W1[x_{k-1}] (when there is a Markov head)
    # Block layout. True (DSpark's own, the paper's): anchor + gamma-1 masks, every slot predicts the next token.
    # False (DFlash's fill-in layout): anchor + gamma masks, the anchor is only context, each mask predicts itself.
    sample_from_anchor: bool = True
    # Reduced draft vocabulary (speculators' d2t/t2d): 0 = the full vocabulary; else the draft's own LM head
    # and the Markov head's output cover these ids, mapped to target ids by ``d2t``.
    draft_vocab_size: int = 0
    # Sequential Temperature Scaling of the confidence head, one temperature per position.
    confidence_temperatures: tuple[float, ...] = ()
    verifier_name_or_path: str = ""
    verifier_architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError("block_size", f"must be >= 1, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("aux_hidden_state_layer_ids", "needs at least one target layer")
        if any(i < 0 for i in self.target_layer_ids):
            raise ConfigError("aux_hidden_state_layer_ids", "layer ids must be >= 0")
        if self.enable_markov_head and self.markov_rank <= 0:
            raise ConfigError("markov_rank", f"must be positive, got {self.markov_rank}")
        if self.markov_head_type not in ("vanilla", "gated", "rnn"):
            raise ConfigError("markov_head_type", f"must be vanilla, gated or rnn, got {self.markov_head_type!r}")
        if list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            raise ConfigError("aux_hidden_state_layer_ids", f"{list(self.target_layer_ids)} must be strictly "
                                                            "increasing (vLLM concatenates the states in layer order)")
        if not 0 <= self.mask_token_id < self.backbone.vocab_size:
            raise ConfigError("mask_token_id", f"{self.mask_token_id} outside vocabulary")
        if self.confidence_temperatures and len(self.confidence_temperatures) != self.block_size:
            raise ConfigError(
                "confidence_temperatures",
                f"needs {self.block_size} entries (one per block position), got "
                f"{len(self.confidence_temperatures)}",
            )
        if any(t <= 0 for t in self.confidence_temperatures):
            raise ConfigError("confidence_temperatures", "temperatures must be positive")
        if not 0 <= self.draft_vocab_size <= self.backbone.vocab_size:
            raise ConfigError("draft_vocab_size", f"{self.draft_vocab_size} must be in [1, vocab_size="
                                                  f"{self.backbone.vocab_size}] (0: the full vocabulary)")

    @property
    def num_feature_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_slots(self) -> int:
        """Input slots of one block: gamma (anchor-as-first) or gamma + 1 (the anchor does not predict)."""
        return self.block_size + (0 if self.sample_from_anchor else 1)

    @property
    def first_prediction_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    @property
    def output_vocab_size(self) -> int:
        """Rows of the draft's logits: the reduced vocabulary, or the full one."""
        return self.draft_vocab_size or self.backbone.vocab_size

    @property
    def reduced_vocab(self) -> bool:
        return 0 < self.draft_vocab_size < self.backbone.vocab_size

    @property
    def confidence_reads_markov(self) -> bool:
        return self.enable_markov_head and self.confidence_with_markov


# One set of bounds for every front door (HTTP, gRPC, CLI; dspark/schema.py and deploy/openai_protocol.py use these)
MAX_TEMPERATURE = 2.0  # OpenAI's
GREEDY_BELOW = 1e-5  # a temperature this small is greedy decoding (dividing logits by it would overflow)
MAX_TOP_K = 1 << 20  # above any vocabulary; larger values are refused, not silently overflowed
MAX_SEED = 2**63 - 1  # the drafter's generator is seeded with seed + 1, which must fit a uint64
MAX_STOPS = 8


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters (validated, immutable)."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ConfigError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ConfigError("top_k", f"must be in [0, {MAX_TOP_K}] (0 disables), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ConfigError("seed", f"must be in [0, {MAX_SEED}], got {self.seed}")
        if len(self.stop) > MAX_STOPS or any(not s for s in self.stop):
            raise ConfigError("stop", f"at most {MAX_STOPS} non-empty stop strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def pinned(self) -> bool:
        """A seeded sampled request: what it drafts and how much of it is verified follow its own record and fixed
        rules only (the draft gate's fixed bar ``pinned_break_even``, its drafts trimmed alone by the fixed cost
        ``pinned_token_cost``, no load-aware switch), so the
        same seed gives the same tokens alone or beside any other traffic."""
        return self.seed is not None and not self.greedy


@dataclass(frozen=True)
class EngineConfig:
    """In-process engine knobs."""

    speculate: bool = True
    block_size: int | None = None  # None: the draft checkpoint's block size
    verification: Literal["token", "block"] = "block"
    scheduler: Literal["confidence", "full"] = "confidence"
    max_num_seqs: int = 16
    kv_block_size: int = 16
    kv_cache_tokens: int = 65536
    max_model_len: int = 4096
    draft_top_k: int = 64  # draft sampled from its top-k tokens (exact probabilities handed on)
    dtype: str = "float32"
    profile_max_tokens: int = 64
    draft_gate: bool = False  # skip drafting for a request while its recent drafts do not pay (draft_gate.py)
    pinned_break_even: float = 0.0  # with the gate: a seeded sampled request's fixed bar (0: it always drafts)
    pinned_token_cost: float = 0.0  # a seeded sampled request's fixed cost of a verified draft token (0: full block)
    draft_sources: Literal["head", "lookup", "hybrid"] = "head"  # where drafts come from (decoding/sources.py)

    def __post_init__(self) -> None:
        if self.verification not in ("token", "block"):
            raise ConfigError("verification", f"must be 'token' or 'block', got {self.verification!r}")
        if self.scheduler not in ("confidence", "full"):
            raise ConfigError("scheduler", f"must be 'confidence' or 'full', got {self.scheduler!r}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", "must be >= 1")
        if self.kv_block_size < 1:
            raise ConfigError("kv_block_size", "must be >= 1")
        if self.kv_cache_tokens < self.kv_block_size:
            raise ConfigError("kv_cache_tokens", "must hold at least one KV block")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError("block_size", "must be >= 1")
        if self.draft_sources not in ("head", "lookup", "hybrid"):
            raise ConfigError("draft_sources", f"must be 'head', 'lookup' or 'hybrid', got {self.draft_sources!r}")
        if self.draft_top_k < 0:
            raise ConfigError("draft_top_k", "must be >= 0 (0: full vocabulary)")
        if not 0 <= self.pinned_token_cost <= 1:
            raise ConfigError("pinned_token_cost", f"must be in [0, 1], got {self.pinned_token_cost}")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError("dtype", f"unsupported dtype {self.dtype!r}")
