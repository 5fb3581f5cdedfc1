"""What exactness costs on vLLM's CPU path, one run: vLLM plain and vLLM + DSpark (our proposer with the config's
draft gate and prefix scheduler, as served; ``--full-blocks``: no gate, full blocks, every round verifies a block)
with the target in bf16 on shape-invariant kernels (``engine.vllm_exact``, the default), in bf16 on vLLM's own
kernels, and in fp32; each at batch 1 and at concurrency 8, greedy and T=1 (top-p 0.95).

For each setting: tokens/s, the ratio to vLLM plain in bf16 on vLLM's own kernels (the fastest plain vLLM here: the
fair baseline), and how many greedy replies equal the same setting's plain batch-1 replies, token for token — at
concurrency 8 (other requests beside each one) and with speculation (rows verified inside blocks). Exact means
every greedy count is full.

    python -m benchmarks.exactness [--prompts 40] [--max-tokens 128] [--temperatures greedy,T=1]
        [--settings invariant,vllm,fp32] [--out exactness.json] [--plot exactness.png]

Pause a training run first (``touch $DSPARK_CACHE/train/distill/PAUSE``): the cores are shared.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peers import CONCURRENCY, vllm_system
from benchmarks.report import DATASETS, REPO, machine
from dspark.evaluation.prompt_sets import round_robin
from dspark.loader import encode_chat, load_tokenizer
from dspark.schema import load_engine_config, write_variant
from dspark.training.prepare import prepare_target

SETTINGS = {  # name: (short name, target dtype, engine.vllm_exact)
    "bf16, invariant kernels": ("invariant", "bfloat16", True),
    "bf16, vLLM's kernels": ("vllm", "bfloat16", False),
    "fp32": ("fp32", "float32", False),
}
TEMPERATURE_LABELS = {"greedy": "greedy", "T=1": "T=1 top-p 0.95"}
BASELINE = ("bf16, vLLM's kernels", "plain")


def run(config_path: Path, prompts_count: int, max_tokens: int,
        settings: tuple[str, ...] = ("invariant", "vllm", "fp32"), temperatures: tuple[str, ...] = ("greedy",),
        full_blocks: bool = False) -> dict:
    config = load_engine_config(config_path)
    if "DSPARK_CACHE" in config.target.path:
        prepare_target()
    # full blocks, no gate: the most rows verified inside blocks, the hardest case for exactness
    engine = {"scheduler": "full", "draft_gate": False} if full_blocks else {}
    variant = write_variant(config, Path(tempfile.mkdtemp()) / "engine.yaml", engine=engine)
    labels = tuple(TEMPERATURE_LABELS[t] for t in temperatures)
    tokenizer = load_tokenizer(config.resolve(config.target.path))
    texts = [t[:600] for t in round_robin(DATASETS, prompts_count)]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    rows = []
    for setting, (short, dtype, exact) in SETTINGS.items():
        if short not in settings and setting != BASELINE[0]:
            continue
        for speculation, name in (("off", "plain"), ("dspark_plugin", "DSpark")):
            if short not in settings and name != BASELINE[1]:
                continue
            start = time.perf_counter()
            result = vllm_system(variant, dtype, speculation, prompts, max_tokens, exact=exact, temperatures=labels)
            for label in labels:
                spec = result.get(f"{label} spec") or {}
                for mode, (outputs, seconds) in result[label].items():
                    tokens = sum(len(o) for o in outputs)
                    rows.append({"setting": setting, "dtype": dtype, "exact_kernels": exact, "system": name,
                                 "temperature": label, "mode": mode, "tok_s": tokens / seconds,
                                 "completion_tokens": tokens,
                                 "tau": 1 + spec["accepted"] / spec["drafts"] if spec.get("drafts") else None,
                                 "outputs": outputs})
            print(f"[exactness] {setting} {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    for r in rows:
        base = next(x for x in rows if (x["setting"], x["system"]) == BASELINE and x["mode"] == r["mode"]
                    and x["temperature"] == r["temperature"])
        r["vs_baseline"] = r["tok_s"] / base["tok_s"]
        reference = next((x for x in rows if x["setting"] == r["setting"] and x["system"] == "plain"
                          and x["mode"] == "batch 1" and x["temperature"] == r["temperature"]), None)
        r["equal_to_plain_batch_1"] = (sum(a == b for a, b in zip(r["outputs"], reference["outputs"]))
                                       if r["temperature"] == "greedy" and reference else None)
    for r in rows:
        del r["outputs"]
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "config": str(config_path),
            "prompts": len(prompts), "max_tokens": max_tokens, "concurrency": CONCURRENCY,
            "speculation": "full blocks, no gate" if full_blocks else "the config's gate and scheduler",
            "baseline": f"vLLM plain, {BASELINE[0]}, same mode and temperature", "rows": rows}


def table(report: dict) -> str:
    lines = [f"{report['prompts']} prompts x {report['max_tokens']} tokens, {report['machine']}; DSpark: "
             f"{report.get('speculation', 'full blocks, no gate')}; ratio: against {report['baseline']}",
             "", "| target | system | sampling | mode | tok/s | vs baseline | tau | greedy = plain batch 1 |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        equal = "-" if r["equal_to_plain_batch_1"] is None else f"{r['equal_to_plain_batch_1']}/{report['prompts']}"
        lines.append(f"| {r['setting']} | {r['system']} | {r.get('temperature', 'greedy')} | {r['mode']} | "
                     f"{r['tok_s']:.1f} | {r['vs_baseline']:.2f}x | {tau} | {equal} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.get("temperature", "greedy"), r["mode"]) for r in report["rows"]},
                    key=lambda p: (p[0] != "greedy", p[1] != "batch 1"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True, squeeze=False)
    for ax, (temperature, mode) in zip(axes[0], panels):
        rows = [r for r in report["rows"] if r["mode"] == mode and r.get("temperature", "greedy") == temperature]
        labels = [f"{r['setting']}\n{r['system']}" for r in rows]
        colours = ["tab:grey" if r["equal_to_plain_batch_1"] is None else
                   "tab:green" if r["equal_to_plain_batch_1"] == report["prompts"] else "tab:red" for r in rows]
        bars = ax.bar(range(len(rows)), [r["tok_s"] for r in rows], color=colours)
        for bar, r in zip(bars, rows):
            equal = r["equal_to_plain_batch_1"]
            equal = "" if equal is None else f"\n{equal}/{report['prompts']}"
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['vs_baseline']:.2f}x{equal}",
                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=7)
        ax.set_title(f"{temperature}, {mode}\n(green: every greedy reply equals plain batch 1)", fontsize=8)
        ax.set_ylabel("tokens/s")
    fig.suptitle(f"vLLM on CPU: what exactness costs ({report['prompts']} prompts x {report['max_tokens']} tokens)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "embedded.yaml")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="greedy", help="comma-separated: greedy, T=1")
    ap.add_argument("--settings", default="invariant,vllm,fp32",
                    help="comma-separated: invariant (bf16, our kernels), vllm (bf16, vLLM's), fp32; vLLM plain bf16 "
                         "on vLLM's kernels, the baseline, always runs")
    ap.add_argument("--full-blocks", action="store_true", help="DSpark without the gate, full blocks")
    ap.add_argument("--out", type=Path, default=Path("exactness.json"))
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    report = run(args.config, args.prompts, args.max_tokens, tuple(args.settings.split(",")),
                 tuple(args.temperatures.split(",")), args.full_blocks)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
