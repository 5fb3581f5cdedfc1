"""Two or more DSpark heads for the same target, side by side on the repo's shared prompt sets, one run.

    python -m benchmarks.head_comparison --draft shipped=models/smollm2-135m-dspark --draft new=PATH \
        [--prompts 30] [--max-tokens 256] [--concurrency 10] [--out heads.json] [--plot heads.png]

What is measured is the head's own acceptance: full blocks every round (``engine.scheduler: full``) and no draft
gate (``engine.draft_gate: false``), greedy and at T = 1 / top-p 0.95 (seeded per request), on ``--prompts`` first
turns taken in turn from humaneval, mbpp, gsm8k and mt-bench, in the chat template, each decoded to
``--max-tokens``. The native engine runs the target in the config's dtype. Requests are decoded ``--concurrency``
at a time: acceptance does not depend on it (the native engine is batch-invariant in bf16, and each request samples
from its own seeded generator), and it makes the run several times shorter than batch 1. Speed is not measured
here (``dspark bench`` and ``benchmarks.peers`` do that against plain decoding); the first ``--draft`` is the
baseline the others' gains are quoted against.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dspark.builder import build_engine
from dspark.config import SamplingParams
from dspark.decoding.metrics import SpecMetrics
from dspark.evaluation.prompt_sets import round_robin
from dspark.loader import encode_prompt
from dspark.schema import load_engine_config

REPO = Path(__file__).resolve().parents[1]
DATASETS = ("humaneval", "mbpp", "gsm8k", "mt-bench")
TEMPERATURES = {"greedy": (0.0, 1.0), "T=1 top-p 0.95": (1.0, 0.95)}


def measure(engine, prompts: list[list[int]], params: SamplingParams, concurrency: int, label: str) -> dict:
    """Decode every prompt (``concurrency`` in flight); pooled acceptance and every prompt's output ids."""
    pending, live, done = list(enumerate(prompts)), {}, {}
    pooled, start = SpecMetrics(), time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, ids = pending.pop(0)
            live[engine.add_request(ids, SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                                        top_p=params.top_p, seed=1000 + i, ignore_eos=False))] = i
        for out in engine.step():
            if not out.finished:
                continue
            result = engine.result(out.request_id)
            pooled, done[live.pop(out.request_id)] = pooled.merge(result.metrics), result.token_ids
            print(f"\r[heads] {label:<36} {len(done)}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {"acceptance_length": pooled.acceptance_length, "acceptance_per_pos": pooled.acceptance_rate_per_pos,
            "completion_tokens": pooled.completion_tokens, "verify_steps": pooled.verify_steps,
            "seconds": time.perf_counter() - start, "outputs": [done[i] for i in sorted(done)]}


def compare(config: Path, drafts: dict[str, str], prompts: int, max_tokens: int, concurrency: int) -> dict:
    base = load_engine_config(config)
    base = base.model_copy(update={"engine": base.engine.model_copy(update={
        "scheduler": "full", "draft_gate": False, "max_num_seqs": concurrency})})
    texts = round_robin(DATASETS, prompts)
    results: dict = {"prompts": prompts, "sets": list(DATASETS), "max_tokens": max_tokens, "concurrency": concurrency,
                     "heads": {}}
    for name, path in drafts.items():
        cfg = base.model_copy(update={"draft": base.draft.model_copy(update={"path": str(Path(path).resolve())})})
        engine = build_engine(cfg, backend="native")
        ids = [encode_prompt(engine.tokenizer, t, chat=True)[-(cfg.engine.max_model_len - max_tokens - 1):]
               for t in texts]
        results["dtypes"] = engine.dtypes
        results["heads"][name] = {"path": str(path), "block_size": engine.block_size, **{
            label: measure(engine, ids, SamplingParams(max_tokens=max_tokens, temperature=t, top_p=p), concurrency,
                           f"{name} {label}")
            for label, (t, p) in TEMPERATURES.items()}}
        engine.shutdown()
    first = next(iter(drafts))
    for head in results["heads"].values():
        for label in TEMPERATURES:
            head[label]["gain_over_" + first] = (head[label]["acceptance_length"]
                                                 / results["heads"][first][label]["acceptance_length"] - 1)
    return results


def table(results: dict) -> str:
    rows = ["| head | sampling | pooled τ | vs first | acceptance per position | tokens | verify steps |",
            "|---|---|---:|---:|---|---:|---:|"]
    for name, head in results["heads"].items():
        for label in TEMPERATURES:
            r = head[label]
            gain = next(v for k, v in r.items() if k.startswith("gain_over_"))
            rows.append(f"| {name} | {label} | {r['acceptance_length']:.3f} | {gain:+.1%} | "
                        f"{' '.join(f'{a:.2f}' for a in r['acceptance_per_pos'])} | {r['completion_tokens']} | "
                        f"{r['verify_steps']} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TEMPERATURES), figsize=(11, 4), sharey=True)
    width = 0.8 / len(results["heads"])
    for ax, label in zip(axes, TEMPERATURES):
        for k, (name, head) in enumerate(results["heads"].items()):
            acc = head[label]["acceptance_per_pos"]
            ax.bar([i + 1 + (k - (len(results["heads"]) - 1) / 2) * width for i in range(len(acc))], acc, width,
                   label=f"{name} (τ {head[label]['acceptance_length']:.2f})")
        ax.set_title(f"{label}: {results['prompts']} prompts × {results['max_tokens']} tokens, full blocks")
        ax.set_xlabel("block position")
        ax.legend()
    axes[0].set_ylabel("acceptance rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--draft", action="append", required=True, help="NAME=PATH of an exported head (repeatable; "
                                                                          "the first is the baseline)")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--out", default="heads.json")
    parser.add_argument("--plot", default="heads.png")
    args = parser.parse_args(argv)
    drafts = dict(d.split("=", 1) for d in args.draft)
    results = compare(Path(args.config), drafts, args.prompts, args.max_tokens, args.concurrency)
    Path(args.out).write_text(json.dumps(results, indent=1))
    plot(results, Path(args.plot))
    print(table(results))
    print(f"dtypes: {json.dumps(results['dtypes'])}; {args.out}, {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
