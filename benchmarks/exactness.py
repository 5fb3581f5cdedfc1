"""What exactness costs on vLLM's CPU path, one run: vLLM plain and vLLM + DSpark (our proposer, full blocks, no gate:
every round verifies a block) with the target in bf16 on shape-invariant kernels (``engine.vllm_exact``, the
default), in bf16 on vLLM's own kernels, and in fp32; each at batch 1 and at concurrency 8, greedy.

For each setting: tokens/s, the ratio to vLLM plain in bf16 on vLLM's own kernels (the fastest plain vLLM here: the
fair baseline), and how many greedy replies equal the same setting's plain batch-1 replies, token for token — at
concurrency 8 (other requests beside each one) and with speculation (rows verified inside blocks). Exact means
every count is full.

    python -m benchmarks.exactness [--prompts 40] [--max-tokens 128] [--out exactness.json] [--plot exactness.png]

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

SETTINGS = {  # name: (target dtype, engine.vllm_exact)
    "bf16, invariant kernels": ("bfloat16", True),
    "bf16, vLLM's kernels": ("bfloat16", False),
    "fp32": ("float32", False),
}
BASELINE = ("bf16, vLLM's kernels", "plain")


def run(config_path: Path, prompts_count: int, max_tokens: int) -> dict:
    config = load_engine_config(config_path)
    if "DSPARK_CACHE" in config.target.path:
        prepare_target()
    # full blocks, no gate: the most rows verified inside blocks, the hardest case for exactness
    variant = write_variant(config, Path(tempfile.mkdtemp()) / "engine.yaml",
                            engine={"scheduler": "full", "draft_gate": False})
    tokenizer = load_tokenizer(config.resolve(config.target.path))
    texts = [t[:600] for t in round_robin(DATASETS, prompts_count)]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    rows = []
    for setting, (dtype, exact) in SETTINGS.items():
        for speculation, name in (("off", "plain"), ("dspark_plugin", "DSpark")):
            start = time.perf_counter()
            result = vllm_system(variant, dtype, speculation, prompts, max_tokens, exact=exact,
                                 temperatures=("greedy",))
            spec = result.get("greedy spec") or {}
            for mode, (outputs, seconds) in result["greedy"].items():
                tokens = sum(len(o) for o in outputs)
                rows.append({"setting": setting, "dtype": dtype, "exact_kernels": exact, "system": name,
                             "mode": mode, "tok_s": tokens / seconds, "completion_tokens": tokens,
                             "tau": 1 + spec["accepted"] / spec["drafts"] if spec.get("drafts") else None,
                             "outputs": outputs})
            print(f"[exactness] {setting} {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    base = next(r for r in rows if (r["setting"], r["system"]) == BASELINE and r["mode"] == "batch 1")
    base_c = next(r for r in rows if (r["setting"], r["system"]) == BASELINE and r["mode"] != "batch 1")
    for r in rows:
        reference = next(x for x in rows if x["setting"] == r["setting"] and x["system"] == "plain"
                         and x["mode"] == "batch 1")["outputs"]
        r["equal_to_plain_batch_1"] = sum(a == b for a, b in zip(r["outputs"], reference))
        r["vs_baseline"] = r["tok_s"] / (base if r["mode"] == "batch 1" else base_c)["tok_s"]
    for r in rows:
        del r["outputs"]
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "config": str(config_path),
            "prompts": len(prompts), "max_tokens": max_tokens, "concurrency": CONCURRENCY,
            "baseline": f"vLLM plain, {BASELINE[0]}, same mode", "rows": rows}


def table(report: dict) -> str:
    lines = [f"{report['prompts']} prompts x {report['max_tokens']} tokens, greedy, {report['machine']}; ratio: "
             f"against {report['baseline']}",
             "", "| target | system | mode | tok/s | vs baseline | tau | greedy = plain batch 1 |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        lines.append(f"| {r['setting']} | {r['system']} | {r['mode']} | {r['tok_s']:.1f} | {r['vs_baseline']:.2f}x "
                     f"| {tau} | {r['equal_to_plain_batch_1']}/{report['prompts']} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in report["rows"]}, key=lambda m: m != "batch 1")
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), sharey=True)
    for ax, mode in zip(axes, modes):
        rows = [r for r in report["rows"] if r["mode"] == mode]
        labels = [f"{r['setting']}\n{r['system']}" for r in rows]
        bars = ax.bar(range(len(rows)), [r["tok_s"] for r in rows],
                      color=["tab:green" if r["equal_to_plain_batch_1"] == report["prompts"] else "tab:red"
                             for r in rows])
        for bar, r in zip(bars, rows):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                    f"{r['vs_baseline']:.2f}x\n{r['equal_to_plain_batch_1']}/{report['prompts']}",
                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=7)
        ax.set_title(f"{mode} (green: every greedy reply equals plain batch 1)", fontsize=9)
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
    ap.add_argument("--out", type=Path, default=Path("exactness.json"))
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    report = run(args.config, args.prompts, args.max_tokens)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
