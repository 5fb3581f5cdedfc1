"""Memory and traffic sizing of a deployment, computed from its configs (no weights needed).

    python -m dspark.sizing --config configs/kimi-k3.1-pro-b300.yaml [--tau 3.3] [--gpu-memory-gib 268]
    python -m dspark.sizing --target configs/targets/kimi-k3.1-pro.json \\
        --draft configs/drafts/kimi-k3.1-pro-dspark.json --gpus 8 [--expert-parallel] [--batch 64 --tau 3.3]

With ``--config`` (a serving YAML) the GPUs, parallelism, batch and KV budget come from the
config and the architectures from ``target.architecture`` / ``draft.architecture`` (or the
checkpoints' own config.json), and the table ends with whether the weights plus the configured
KV budget fit the GPU's memory.

Prints, per GPU, the target's weight bytes under the chosen parallelism (attention and dense
MLPs split by tensor parallelism, experts split or owned whole, embedding/LM head replicated
as this project does), the target's KV-cache bytes per token (MLA stores one latent per token
and layer, replicated on every rank), the draft's weights and cache, and the hidden-state bytes
the target sends the drafter per verify step.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark.config import DecoderConfig, DraftConfig
from dspark.formats.checkpoint import draft_config_from_json
from dspark.model.kimi_k3 import MODEL_TYPES as KIMI_K3_TYPES
from dspark.model.kimi_k3 import KimiK3Config

TargetShape = DecoderConfig | KimiK3Config


def read_target_architecture(data: dict) -> TargetShape:
    """A target config.json: a dense / MLA / MoE decoder, or Kimi-K3's hybrid (sized here, served by vLLM)."""
    if data.get("model_type") in KIMI_K3_TYPES:
        return KimiK3Config.from_hf(data)
    return DecoderConfig.from_hf(data)

GIB = 1 << 30


@dataclass
class Sizing:
    gpus: int
    expert_parallel: bool
    target_params: float
    target_weight_bytes_per_gpu: float
    target_kv_bytes_per_token_per_gpu: float
    draft_weight_bytes: float
    draft_kv_bytes_per_token: float
    feature_bytes_per_token: float
    feature_bytes_per_step: float
    target_state_bytes_per_sequence_per_gpu: float = 0.0  # linear-attention (KDA) state: fixed per sequence


def _attention_params(cfg: DecoderConfig) -> tuple[float, float]:
    """(replicated, split) parameter counts of one attention layer."""
    h = cfg.hidden_size
    if cfg.attention == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q_a = h * cfg.q_lora_rank + cfg.q_lora_rank if cfg.q_lora_rank else 0
        q_b = (cfg.q_lora_rank or h) * cfg.num_heads * qk
        kv_a = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
        kv_b = cfg.kv_lora_rank * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        o = cfg.num_heads * cfg.v_head_dim * h
        return q_a + kv_a, q_b + kv_b + o
    q = h * cfg.num_heads * cfg.head_dim
    kv = 2 * h * cfg.num_kv_heads * cfg.head_dim
    return 0.0, q + kv + cfg.num_heads * cfg.head_dim * h


def _decoder_layer_shapes(cfg: DecoderConfig) -> list[tuple[float, float, int, float, float]]:
    """Per layer: (replicated, split by tensor parallelism, routed experts, params per expert, other FFN split)."""
    h, shapes = cfg.hidden_size, []
    for index in range(cfg.num_layers):
        rep, split = _attention_params(cfg)
        rep += 2 * h  # norms
        if cfg.n_routed_experts and index >= cfg.first_k_dense_replace:
            expert = 3 * h * cfg.moe_intermediate_size
            rep += cfg.n_routed_experts * h + cfg.n_routed_experts  # router and its bias
            shapes.append((rep, split, cfg.n_routed_experts, expert, cfg.n_shared_experts * expert))
        else:
            shapes.append((rep, split, 0, 0.0, 3 * h * cfg.intermediate_size))
    return shapes


def target_sizing(cfg: TargetShape, gpus: int, expert_parallel: bool, weight_bytes: float = 1.0,
                  kv_bytes: float = 2.0) -> tuple[float, float, float]:
    """(total parameters, weight bytes per GPU, KV bytes per token per GPU)."""
    h = cfg.hidden_size
    replicated = 2 * cfg.vocab_size * h + h  # embedding, LM head, final norm (bf16 in practice, counted below)
    total, per_gpu = float(replicated), replicated * 2.0  # embedding and LM head stay bf16 (not block-quantised)
    shapes = cfg.layer_shapes() if isinstance(cfg, KimiK3Config) else _decoder_layer_shapes(cfg)
    for rep, split, experts, expert, other_ffn in shapes:
        # routed experts: owned whole (expert parallelism) or sliced (tensor parallelism); the rest is sliced
        routed = -(-experts // gpus) * expert if expert_parallel else experts * expert / gpus
        total += rep + split + experts * expert + other_ffn
        per_gpu += (rep + (split + other_ffn) / gpus + routed) * weight_bytes
    if isinstance(cfg, KimiK3Config):
        return total, per_gpu, cfg.kv_bytes_per_token(kv_bytes)
    heads, key_dim, value_dim = cfg.cache_geometry
    kv = cfg.num_layers * heads * (key_dim + value_dim) * kv_bytes
    if cfg.attention != "mla":
        kv /= gpus  # KV heads split by tensor parallelism; the MLA latent is replicated on each rank
    return total, per_gpu, kv


def draft_sizing(draft: DraftConfig, dtype_bytes: float = 2.0) -> tuple[float, float]:
    """(draft weight bytes without the shared embedding/LM head, context KV bytes per token)."""
    b = draft.backbone
    attn_rep, attn_split = _attention_params(b)
    layer = attn_rep + attn_split + 3 * b.hidden_size * b.intermediate_size + 2 * b.hidden_size
    fc = len(draft.target_layer_ids) * draft.target_hidden_size * b.hidden_size
    markov = draft.markov_rank * (b.vocab_size + b.hidden_size) if draft.markov_rank else 0
    weights = (b.num_layers * layer + fc + markov) * dtype_bytes
    heads, key_dim, value_dim = b.cache_geometry
    kv = b.num_layers * heads * (key_dim + value_dim) * dtype_bytes
    return weights, kv


def sizing(target: TargetShape, draft: DraftConfig, gpus: int, expert_parallel: bool, batch: int,
           tau: float, weight_bytes: float = 1.0) -> Sizing:
    total, per_gpu, kv = target_sizing(target, gpus, expert_parallel, weight_bytes)
    draft_weights, draft_kv = draft_sizing(draft)
    feature = len(draft.target_layer_ids) * target.hidden_size * 2.0  # bf16 hidden states per committed token
    state = (target.state_bytes_per_sequence(draft.block_size) / gpus if isinstance(target, KimiK3Config) else 0.0)
    return Sizing(gpus, expert_parallel, total, per_gpu, kv, draft_weights, draft_kv, feature,
                  feature * batch * tau, state)


def _read(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


@dataclass
class Deployment:
    """What a serving YAML says about one replica, for sizing."""

    target: TargetShape
    draft: DraftConfig | None
    gpus: int
    expert_parallel: bool
    batch: int
    kv_cache_tokens: int
    weight_bytes: float
    kv_bytes: float = 2.0  # bytes per KV-cache element (the serving dtype's)
    backend: str = "native"  # engine.backend: vllm colocates the drafter, sharded over the target's GPUs
    drafting: bool = True  # the draft runs (native: speculate; vllm: vllm_speculation 'dspark')


def vllm_kv_cache_bytes(plan: Deployment, drafting: bool) -> int:
    """vLLM's ``kv_cache_memory_bytes`` per worker (GPU, or the CPU engine) that holds the config's KV budget.

    vLLM keeps one cache pool per worker for every attention layer it runs: the target's KV cache of
    ``kv_cache_tokens`` tokens (GQA heads split over the tensor-parallel ranks, an MLA latent replicated on each),
    a linear-attention target's fixed state for ``max_num_seqs`` sequences, and with a colocated DSpark drafter its
    layers' context cache of the same tokens, sharded as the target is.
    """
    _, _, target_kv = target_sizing(plan.target, plan.gpus, plan.expert_parallel, plan.weight_bytes, plan.kv_bytes)
    total = target_kv * plan.kv_cache_tokens
    if isinstance(plan.target, KimiK3Config):
        drafted = plan.draft.block_size if drafting and plan.draft is not None else 0
        total += plan.target.state_bytes_per_sequence(drafted) / plan.gpus * plan.batch
    if drafting and plan.draft is not None:
        _, draft_kv = draft_sizing(plan.draft, plan.kv_bytes)
        split = plan.gpus if plan.draft.backbone.attention != "mla" else 1
        total += draft_kv / split * plan.kv_cache_tokens
    return int(-(-total // 1))


def _architecture(config, spec) -> dict:
    path = config.resolve(spec.architecture) if spec.architecture else config.resolve(spec.path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no architecture for {spec.path}: {path} missing (set .architecture)")
    return _read(path)


def deployment_from_config(path_or_config) -> Deployment:
    """What a serving YAML (a path, or an already loaded ``EngineFileConfig``) says about one replica."""
    from dspark.schema import load_engine_config

    config = load_engine_config(path_or_config) if isinstance(path_or_config, (str, Path)) else path_or_config
    target_json = _architecture(config, config.target)
    draft = draft_config_from_json(_architecture(config, config.draft)) if config.draft.path else None
    quant = (target_json.get("quantization_config") or (target_json.get("text_config") or {}).get(
        "quantization_config") or {})  # Kimi-K3 keeps it in text_config (vLLM copies it up)
    fp8_resident = quant.get("quant_method") == "fp8" and config.target.fp8_mode(
        on_gpu=config.runtime.shard_gpus > 0) == "matmul"  # dequantised at load, FP8 weights take dtype's bytes
    dtype_bytes = {"float32": 4.0, "float64": 8.0}.get(config.target.dtype, 2.0)
    return Deployment(read_target_architecture(target_json), draft, config.runtime.tp_size,
                      config.runtime.expert_parallel, config.engine.max_num_seqs, config.engine.kv_cache_tokens,
                      1.0 if fp8_resident else dtype_bytes, dtype_bytes, config.engine.backend,
                      config.engine.speculate and bool(config.draft.path)
                      and (config.engine.backend == "native" or config.engine.vllm_speculation == "dspark"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="serving YAML: GPUs, parallelism, batch and KV budget from it")
    parser.add_argument("--target", help="target config.json (without --config)")
    parser.add_argument("--draft", help="draft config.json, speculators layout (without --config)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences per verify step (default: the config's max_num_seqs, else 64)")
    parser.add_argument("--tau", type=float, default=3.3, help="acceptance length (committed tokens per step)")
    parser.add_argument("--weight-bytes", type=float, default=1.0, help="bytes per target weight (1 = FP8)")
    parser.add_argument("--gpu-memory-gib", type=float, default=268.0,
                        help="memory per GPU for the fit check (B300: 288 GB = 268 GiB)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    kv_tokens = None
    if args.config:
        plan = deployment_from_config(args.config)
        if plan.draft is None:
            parser.error(f"{args.config} serves no draft")
        target, draft, kv_tokens = plan.target, plan.draft, plan.kv_cache_tokens
        args.gpus, args.expert_parallel, args.weight_bytes = plan.gpus, plan.expert_parallel, plan.weight_bytes
        args.batch = args.batch or plan.batch
    elif args.target and args.draft:
        target, draft = read_target_architecture(_read(args.target)), draft_config_from_json(_read(args.draft))
    else:
        parser.error("give --config, or both --target and --draft")
    args.batch = args.batch or 64
    s = sizing(target, draft, args.gpus, args.expert_parallel, args.batch, args.tau, args.weight_bytes)
    fit = None
    if kv_tokens and plan.backend == "vllm":
        fit = vllm_fit_check(s, plan, args.gpu_memory_gib)
    elif kv_tokens:
        fit = fit_check(s, target, kv_tokens, args.gpu_memory_gib, args.batch)
    if args.json:
        print(json.dumps({**asdict(s), **({"fit": fit} if fit else {})}, indent=1))
        return 0
    mode = "expert parallel" if s.expert_parallel else "tensor parallel"
    rows = [
        ("target parameters", f"{s.target_params / 1e9:.0f} B"),
        (f"target weights per GPU ({mode}, {s.gpus} GPUs)", f"{s.target_weight_bytes_per_gpu / GIB:.1f} GiB"),
        ("target KV cache per token per GPU (MLA latent)", f"{s.target_kv_bytes_per_token_per_gpu / 1024:.1f} KiB"),
        *([("target KDA state per sequence per GPU", f"{s.target_state_bytes_per_sequence_per_gpu / 2**20:.1f} MiB")]
          if s.target_state_bytes_per_sequence_per_gpu else []),
        ("draft weights (embedding/LM head shared)", f"{s.draft_weight_bytes / GIB:.2f} GiB"),
        ("draft context cache per token", f"{s.draft_kv_bytes_per_token / 1024:.1f} KiB"),
        ("hidden states sent to the drafter per token", f"{s.feature_bytes_per_token / 1024:.1f} KiB"),
        (f"... per verify step (batch {args.batch}, tau {args.tau})",
         f"{s.feature_bytes_per_step / (1 << 20):.1f} MiB"),
    ]
    if fit:
        rows += [
            ((f"vLLM kv_cache_memory_bytes per GPU ({kv_tokens} tokens of target and draft"
              if plan.backend == "vllm" else f"target KV cache per GPU ({kv_tokens} tokens")
             + (f", + KDA state of {args.batch} sequences)" if s.target_state_bytes_per_sequence_per_gpu else ")"),
             f"{fit['kv_gib']:.1f} GiB"),
            (fit["busiest_what"], f"{fit['busiest_gpu_gib']:.1f} GiB of {args.gpu_memory_gib:.0f} GiB"),
        ]
    print("| quantity | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0 if fit is None or fit["fits"] else 1


def fit_check(s: Sizing, target: TargetShape, kv_tokens: int, gpu_memory_gib: float, batch: int = 0) -> dict:
    """Does the busiest GPU (a target shard plus the drafter with its copy of the embedding and LM
    head) hold its weights, the configured KV budget and ``batch`` sequences' linear-attention state,
    leaving 10% for activations?"""
    kv = s.target_kv_bytes_per_token_per_gpu * kv_tokens + s.target_state_bytes_per_sequence_per_gpu * batch
    head_copy = 2 * target.vocab_size * target.hidden_size * 2.0  # the drafter's bf16 embedding + LM head
    draft = s.draft_weight_bytes + head_copy + s.draft_kv_bytes_per_token * kv_tokens
    busiest = (s.target_weight_bytes_per_gpu + kv + draft) / GIB
    return {"kv_gib": kv / GIB, "busiest_gpu_gib": busiest, "fits": busiest <= 0.9 * gpu_memory_gib,
            "busiest_what": "weights + KV cache on the GPU that also holds the drafter"}


def vllm_fit_check(s: Sizing, plan: Deployment, gpu_memory_gib: float) -> dict:
    """vLLM's accounting: every GPU holds its target shard, its shard of the colocated drafter (which shares the
    target's embedding and LM head) and ``kv_cache_memory_bytes`` (:func:`vllm_kv_cache_bytes`: target KV, linear-
    attention state and the drafter's context cache); vLLM's default ``gpu_memory_utilization`` of 0.9 leaves the
    rest for activations, CUDA graphs and NCCL buffers."""
    kv = vllm_kv_cache_bytes(plan, plan.drafting)
    draft = s.draft_weight_bytes / plan.gpus if plan.drafting else 0.0
    per_gpu = (s.target_weight_bytes_per_gpu + draft + kv) / GIB
    return {"kv_gib": kv / GIB, "busiest_gpu_gib": per_gpu, "fits": per_gpu <= 0.9 * gpu_memory_gib,
            "kv_cache_memory_bytes": kv,
            "busiest_what": "weights + kv_cache_memory_bytes per GPU (vLLM, drafter sharded with the target)"}


if __name__ == "__main__":
    raise SystemExit(main())
