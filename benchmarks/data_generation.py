"""Training-data throughput: the recipe's response generation on the native engine against vLLM's, one run.

The same decontaminated prompts of ``dspark.training.dataset.build_prompts`` (the recipe's mix), the same sampling
(half greedy, half T=1 / top-p 0.95) and the same batch go through ``dspark.training.dataset.generate_responses``
once per engine (``data.engine`` of the training recipe: ``native`` or ``vllm``), each writing its own JSONL rows;
the figure is response tokens written per second of generation (engine start-up is reported apart).

    python -m benchmarks.data_generation [--prompts 96] [--batch 48] [--max-tokens 128] [--dtype bfloat16]
        [--engines native,vllm] [--out data_generation.json]

``--batch 32,64,128`` measures each engine at each batch (sequences decoded together), for the recipe's
``data.batch``; the ratio column is against the first row.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.report import machine
from dspark.evaluation.prompt_sets import PROMPT_SETS_DIR
from dspark.formats.target_checkpoint import load_target
from dspark.jsonl import read_jsonl
from dspark.loader import load_tokenizer
from dspark.training.dataset import build_prompts, decontaminate, generate_responses
from dspark.training.prepare import prepare_target
from dspark.training.recipe import DataSpec, response_engine


def measure(engine_name: str, prompts: list[str], batch: int, max_tokens: int, dtype: str, target_dir: Path,
            target, tokenizer, out_dir: Path) -> dict:
    spec = DataSpec(num_prompts=len(prompts), max_tokens=max_tokens, batch=batch, engine=engine_name, dtype=dtype)
    started = time.perf_counter()
    engine = response_engine(spec, target, target_dir, tokenizer)
    startup = time.perf_counter() - started
    rows = out_dir / f"{engine_name}.jsonl"
    started = time.perf_counter()
    tokens = generate_responses(engine, tokenizer, prompts, rows, max_tokens, log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - started
    engine.shutdown()
    written = read_jsonl(rows)
    assert len(written) == len(prompts) and sum(len(r["response_ids"]) for r in written) == tokens
    return {"engine": engine_name, "startup_s": startup, "seconds": seconds, "response_tokens": tokens,
            "tokens_per_s": tokens / seconds, "rows": len(written)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--batch", default="48", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--engines", default="native,vllm")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    target_dir = prepare_target()
    target, tokenizer = load_target(target_dir), load_tokenizer(target_dir)
    prompts = decontaminate(build_prompts(args.prompts * 2, seed=7), PROMPT_SETS_DIR)[: args.prompts]
    batches = [int(b) for b in args.batch.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.engines.split(","):
            for batch in batches:
                print(f"[{name}] {len(prompts)} prompts, batch {batch}, up to {args.max_tokens} tokens each",
                      flush=True)
                run_dir = Path(tmp) / f"batch{batch}"
                run_dir.mkdir()
                results.append({"batch": batch, **measure(name, prompts, batch, args.max_tokens, args.dtype,
                                                          target_dir, target, tokenizer, run_dir)})
    base = results[0]["tokens_per_s"]
    print(f"\n{machine()}; target {args.dtype}; {len(prompts)} prompts, max {args.max_tokens} tokens")
    print(f"{'engine':8} {'batch':>5} {'start-up s':>10} {'gen s':>8} {'tokens':>8} {'tok/s':>8} {'ratio':>6}")
    for r in results:
        print(f"{r['engine']:8} {r['batch']:5d} {r['startup_s']:10.1f} {r['seconds']:8.1f} {r['response_tokens']:8d} "
              f"{r['tokens_per_s']:8.1f} {r['tokens_per_s'] / base:5.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "dtype": args.dtype, "batches": batches,
                                        "max_tokens": args.max_tokens, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
