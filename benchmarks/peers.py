"""Peers on this machine, same target, same prompts, one run: DSpark against plain ``transformers``
generation and ``transformers``' prompt-lookup decoding.

    python -m benchmarks.peers --config configs/embedded.yaml --dataset mt-bench \\
        --limit 8 --max-tokens 128 [--out peers.json]

Every system decodes each prompt's first turn (chat template) greedily at batch 1, after one
warm-up prompt; tokens/s is completion tokens over wall time. Greedy outputs of every system are
compared with plain ``transformers`` (they must agree token for token: all of them are lossless).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dspark.config import SamplingParams
from dspark.loader import build_engine, encode_prompt
from dspark.prompt_sets import read_prompts
from dspark.schema import load_engine_config


def _hf_generate(model, prompt_ids: list[int], max_tokens: int, eos: list[int], **extra) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **extra)
    return out[0, len(prompt_ids):].tolist()


def _timed(name: str, fn, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    fn(prompts[0])  # warm-up
    outputs, start = [], time.perf_counter()
    for index, prompt in enumerate(prompts):
        outputs.append(fn(prompt))
        print(f"\r[peers] {name:<28} {index + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return outputs, time.perf_counter() - start


def _strip_eos(ids: list[int], eos: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def run(config_path: Path, dataset: str | Path, limit: int, max_tokens: int, threads: int | None = None) -> dict:
    import transformers

    if threads:
        torch.set_num_threads(threads)
    config = load_engine_config(config_path)
    spec_engine = build_engine(config)
    plain_engine = build_engine(config.model_copy(update={"engine": config.engine.model_copy(
        update={"speculate": False})}))
    tokenizer = spec_engine.tokenizer
    prompts = [encode_prompt(tokenizer, text, chat=True) for text in read_prompts(dataset, limit)]
    eos = sorted(spec_engine.eos_ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(config.resolve(config.target.path)),
                                                              dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    systems = {
        "transformers generate": lambda p: _hf_generate(model, p, max_tokens, eos),
        "transformers prompt lookup": lambda p: _hf_generate(model, p, max_tokens, eos, prompt_lookup_num_tokens=10),
        "dspark plain (no drafter)": lambda p: plain_engine.generate([p], params)[0].token_ids,
        "dspark speculative": lambda p: spec_engine.generate([p], params)[0].token_ids,
    }
    results, reference = {}, None
    for name, fn in systems.items():
        outputs, seconds = _timed(name, fn, prompts)
        outputs = [_strip_eos(o, eos) for o in outputs]
        tokens = sum(len(o) for o in outputs)
        if reference is None:
            reference = outputs
        results[name] = {"completion_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                         "same_tokens_as_transformers": sum(a == b for a, b in zip(outputs, reference))}
    base = results["transformers generate"]["tok_s"]
    for entry in results.values():
        entry["speedup_vs_transformers"] = entry["tok_s"] / base
    return {"dataset": str(dataset), "prompts": len(prompts), "max_tokens": max_tokens,
            "torch_threads": torch.get_num_threads(), "systems": results}


def table(report: dict) -> str:
    lines = [f"| system ({report['prompts']} prompts x {report['max_tokens']} tokens, greedy, batch 1) | tok/s | "
             "vs transformers | outputs equal to transformers |", "|---|---|---|---|"]
    for name, r in report["systems"].items():
        lines.append(f"| {name} | {r['tok_s']:.1f} | {r['speedup_vs_transformers']:.2f}x | "
                     f"{r['same_tokens_as_transformers']}/{report['prompts']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/embedded.yaml")
    parser.add_argument("--dataset", default="mt-bench", help="a named prompt set or a JSONL path")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = run(Path(args.config), args.dataset, args.limit, args.max_tokens, args.threads)
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
