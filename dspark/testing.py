"""Small real checkpoints for tests and demos, built with ``transformers`` and ``tokenizers``.

``make_tiny_target`` writes a randomly initialised Llama / Qwen2 / Qwen3 checkpoint with a
byte-level BPE tokenizer trained on the given texts (a chat template included), in exactly the
layout a real Hugging Face checkpoint has, so the same loaders serve it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.config import DecoderConfig, DraftConfig

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


def train_tokenizer(texts: list[str], vocab_size: int, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token="<|mask|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def make_tiny_target(
    path: str | Path,
    texts: list[str],
    model_type: str = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    logit_scale: float = 1.0,
) -> Path:
    """A random tiny decoder in Hugging Face format (weights scaled so greedy text is not degenerate)."""
    import transformers

    path = Path(path)
    tokenizer = train_tokenizer(texts, vocab_size, path)
    cls_config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[model_type]
    config = cls_config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=model_type != "llama", eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2 if "embed" not in name else 1.0)
        if logit_scale != 1.0 and not config.tie_word_embeddings:
            model.lm_head.weight.mul_(logit_scale)
    model.to(dtype).save_pretrained(str(path), safe_serialization=True)
    return path


def tiny_draft_config(target: DecoderConfig, block_size: int = 4, num_layers: int = 1, markov_rank: int = 16,
                      layer_ids: tuple[int, ...] | None = None, mask_token_id: int | None = None) -> DraftConfig:
    backbone = DecoderConfig(
        hidden_size=target.hidden_size, intermediate_size=target.hidden_size * 2, num_layers=num_layers,
        num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
        vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps, rope=target.rope, model_type="llama",
    )
    ids = layer_ids or tuple(sorted({0, target.num_layers // 2, target.num_layers - 1}))
    return DraftConfig(backbone=backbone, target_hidden_size=target.hidden_size, target_layer_ids=ids,
                       block_size=block_size, markov_rank=markov_rank,
                       mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id)


def make_tiny_deepseek(path: str | Path, tokenizer_dir: str | Path, dtype: torch.dtype = torch.float32,
                       weight_std: float | None = 0.2, max_shard_size: str | None = None,
                       rope_scaling: dict | None = None):
    """A random 3-layer DeepSeek-V3 (1 dense + 2 MoE layers, 8 experts in 4 groups) saved by transformers.

    ``max_shard_size`` (e.g. "40KB") splits the weights over several files with an index, as big
    checkpoints are published. Returns the path and the transformers model.
    """
    import shutil

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
        **({"rope_scaling": rope_scaling} if rope_scaling else {}))
    model = DeepseekV3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # transformers initialises the router at zero and the bias at zero: make routing matter
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        for name, param in model.named_parameters():  # larger weights: distinct, stable greedy paths
            if weight_std and "norm" not in name and "gate.weight" not in name:
                param.normal_(0, weight_std)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    for file in Path(tokenizer_dir).glob("*token*"):
        shutil.copy(file, path / file.name)
    return path, model


def quantize_checkpoint(source: str | Path, out: str | Path, block: tuple[int, int]) -> int:
    """Copy a checkpoint directory with every 2-D ``*_proj.weight`` as FP8 e4m3 + block ``weight_scale_inv``.

    The layout DeepSeek-V3 / Kimi publish (norms, embeddings, router stay as they were); file
    split and index are kept. Returns how many tensors were quantised.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from dspark.model.fp8 import quantize

    source, out = Path(source), Path(out)
    shutil.copytree(source, out)
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    count = 0
    for file in sorted(out.glob("*.safetensors")):
        quantised = {}
        for name, tensor in load_file(str(file)).items():
            if name.endswith("_proj.weight") and tensor.dim() == 2:  # attention and expert projections
                quantised[name], quantised[name + "_scale_inv"] = quantize(tensor, block)
                if index is not None:
                    index["weight_map"][name + "_scale_inv"] = file.name
                count += 1
            else:
                quantised[name] = tensor
        save_file(quantised, str(file), metadata={"format": "pt"})
    if index is not None:
        index_file.write_text(json.dumps(index, indent=2))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return count
