"""Building a ready engine (target, tokenizer, drafter) from a validated config."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from dspark.config import ConfigError, EngineConfig
from dspark.decoding.drafter import DSparkDrafter
from dspark.formats.checkpoint import load_draft
from dspark.model.target_model import DTYPES, TargetModel
from dspark.schema import EngineFileConfig

log = logging.getLogger("dspark")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The target's tokenizer; ``trust_remote_code`` runs the tokenizer code shipped beside it (Kimi's tiktoken
    tokenizer needs it, as ``vllm serve --trust-remote-code`` does)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError("target.path", f"cannot load a tokenizer from {path}: {exc}") from None


def build_drafter(cfg: EngineFileConfig, target: TargetModel, engine_cfg: EngineConfig) -> DSparkDrafter | None:
    if not engine_cfg.speculate or not cfg.draft.path:
        return None
    draft_path = cfg.resolve(cfg.draft.path)
    if not draft_path.is_dir():
        raise ConfigError("draft.path", f"{draft_path} is not a directory")
    draft = load_draft(draft_path, target.config, DTYPES[cfg.draft.dtype])
    draft.bind_target(target.embed_tokens, target.lm_head, head_in_draft_dtype=True)
    return DSparkDrafter(draft, engine_cfg.kv_cache_tokens, engine_cfg.kv_block_size, engine_cfg.draft_top_k,
                         engine_cfg.block_size)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt, optionally as one user turn in the target's chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer.encode(text))


_MARK = "\ue000{}\ue001"  # private-use code points around a message's index: where its content goes
_MARKS = re.compile("\ue000(\\d+)\ue001")


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation in the target's chat template, ready for the assistant's turn.

    Message contents are text: a special token spelled inside one (``<|im_start|>system``...) is encoded
    as the characters it is made of, never as the control token, so a user cannot open a turn of
    another role. The template itself keeps its control tokens. (The template is rendered with a marker
    in place of each content; the pieces between markers are the template's, encoded with special tokens,
    the contents are encoded with ``split_special_tokens``.)"""
    if not tokenizer.chat_template:
        raise ConfigError("messages", "the target's tokenizer has no chat template; send a plain prompt")
    contents = [m["content"] for m in messages]
    text = tokenizer.apply_chat_template(
        [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)], add_generation_prompt=True, tokenize=False)
    parts = _MARKS.split(text)  # template text, index, template text, index, ... (one pass over the text)
    if [int(i) for i in parts[1::2]] != list(range(len(messages))):
        return _encode_rendered(tokenizer, messages)  # the template drops, repeats or reorders contents
    ids: list[int] = []
    for template_text, content in zip(parts[0::2], contents):
        ids += tokenizer.encode(template_text, add_special_tokens=False)
        ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
    return ids + list(tokenizer.encode(parts[-1], add_special_tokens=False))


def _encode_rendered(tokenizer, messages: list[dict]) -> list[int]:
    """A template that transforms contents: render them in, refusing contents that spell a special token."""
    specials = [t for t in tokenizer.all_special_tokens if t]
    for i, message in enumerate(messages):
        if any(t in message["content"] for t in specials):
            raise ConfigError(f"messages.{i}.content", "contains the text of a special token, which this "
                                                       "model's chat template cannot carry as text")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
