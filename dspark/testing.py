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
