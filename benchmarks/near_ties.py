"""How often speculative greedy output differs from plain greedy output, per dtype, and why.

Same prompts, same config, greedy: plain decoding (one row per step) against speculative decoding
(rows verified inside blocks). In bf16 the CPU kernels are made batch-invariant (``dspark/model/attention.py``,
``dspark.model.layers.Linear``), so outputs must be equal. In fp32 the CPU's GEMM rounds a row differently
by the number of rows in the call, so a position whose two best tokens are within rounding of each
other can flip. For each differing prompt this prints the first differing position and the gap
between the two tokens' logits there, computed independently by ``transformers`` in fp32 on the
shared prefix: a flip is an exact near-tie when that gap is at rounding level (~1e-4 of the logits).

    python -m benchmarks.near_ties [--dtypes float32,bfloat16] [--per-set 8] [--max-tokens 128] [--out near_ties.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.report import DATASETS, REPO, machine
from dspark.builder import build_engine
from dspark.config import SamplingParams
from dspark.evaluation.prompt_sets import read_prompts
from dspark.loader import encode_prompt
from dspark.schema import load_engine_config
from dspark.training.prepare import prepare_target


def logit_gap(model, ids: list[int], a: int, b: int) -> dict:
    """Logits of tokens ``a`` (plain) and ``b`` (speculative) after ``ids``, fp32, in ``transformers``.

    ``margin`` is how far the lower of the two sits below the fp32 best token: a flip is a near-tie of the two
    engines' kernels when both choices are within the dtype's rounding of the best, whichever token that is (in bf16
    three candidates can sit within one rounding step, so the fp32 reference may pick a third)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()  # [V]
    top = torch.topk(logits, 2).values
    return {"plain_logit": float(logits[a]), "spec_logit": float(logits[b]), "gap": float(logits[a] - logits[b]),
            "top2_gap": float(top[0] - top[1]),
            "margin": float(top[0] - torch.minimum(logits[a], logits[b])), "logit_scale": float(logits.abs().max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--per-set", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="near_ties.json")
    args = parser.parse_args(argv)
    config = load_engine_config(args.config)
    if "DSPARK_CACHE" in config.target.path:
        prepare_target()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    texts = {name: read_prompts(name, args.per_set) for name in DATASETS}
    hf = None
    report: dict = {"machine": machine(), "max_tokens": args.max_tokens, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        cfg = config.model_copy(update={"target": config.target.model_copy(update={"dtype": dtype}),
                                        "draft": config.draft.model_copy(update={"dtype": dtype})})
        plain, spec = build_engine(cfg, speculate=False, backend="native"), build_engine(cfg, backend="native")
        rows = []
        for name, group in texts.items():
            prompts = [encode_prompt(plain.tokenizer, t, chat=True) for t in group]
            a = [r.token_ids for r in plain.generate(prompts, params)]
            b = [r.token_ids for r in spec.generate(prompts, params)]
            for i, (p, x, y) in enumerate(zip(prompts, a, b)):
                row = {"set": name, "index": i, "equal": x == y, "tokens": len(x)}
                if x != y:
                    d = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
                    row["first_difference"] = d
                    if d < min(len(x), len(y)):
                        if hf is None:
                            from transformers import AutoModelForCausalLM

                            hf = AutoModelForCausalLM.from_pretrained(str(cfg.resolve(cfg.target.path)),
                                                                      torch_dtype=torch.float32).eval()
                        row.update(logit_gap(hf, p + x[:d], x[d], y[d]))
                rows.append(row)
                print(f"\r[near-ties] {dtype} {name} {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
        differ = [r for r in rows if not r["equal"]]
        report["dtypes"][dtype] = {"prompts": len(rows), "differ": len(differ), "rows": rows,
                                   "drafted_tokens_accepted": spec.metrics.num_accepted_tokens}
        print(f"\n{dtype}: {len(differ)} of {len(rows)} prompts differ", file=sys.stderr)
        for r in differ:
            gap = f"logit gap {r['gap']:+.2e} (scale {r['logit_scale']:.1f})" if "gap" in r else "length only"
            print(f"  {r['set']}[{r['index']}] at token {r['first_difference']}: {gap}", file=sys.stderr)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
