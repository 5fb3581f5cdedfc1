"""What the front door's own deployment costs (``serving.front_door: deployment``, the split that lets a lost
replica's requests be carried over) against a replica serving the API itself (``in_replica``), in one run.

The same config (default: the embedded default as shipped), one engine replica, ``serve run`` of each variant in
turn, driven by ``dspark loadtest`` over HTTP (streamed chat completions, greedy, speculation on) at concurrency 1
and 8: throughput, time to first token and inter-token latency at p50. The split adds one Serve handle hop per
streamed event (front door -> engine replica) and a process in front of the replica.

    python -m benchmarks.front_door_split [--config configs/embedded.yaml] [--requests 16] [--max-tokens 64]
        [--out docs/figures/front-door-split.json] [--plot docs/figures/front-door-split.png]

Pause any background training first: the two cores are shared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.report import DATASETS, REPO, SERVE_CONFIG, Served, _bin, machine
from dspark.evaluation.prompt_sets import round_robin
from dspark.schema import load_engine_config, write_variant
from dspark.training.prepare import prepare_target

MODES = ("in_replica", "deployment")
LEVELS = (1, 8)


def run_mode(config_path: Path, mode: str, work: Path, prompts_file: Path, requests: int, max_tokens: int) -> dict:
    variant = write_variant(load_engine_config(config_path), work / f"split-{mode}.json",
                            serving={"front_door": mode, "num_replicas": 1, "load_aware_speculation": False})
    serve_yaml = work / f"serve-split-{mode}.yaml"
    serve_yaml.write_text(SERVE_CONFIG.format(config=variant))
    report = work / f"split-{mode}-load.json"
    with Served(serve_yaml, work / f"serve-split-{mode}.log"):
        subprocess.run([_bin("dspark"), "loadtest", "--dataset", str(prompts_file), "--concurrency",
                        ",".join(map(str, LEVELS)), "--requests", str(requests), "--max-tokens", str(max_tokens),
                        "--temperature", "0", "--top-p", "1.0", "--modes", "on", "--out", str(report)],
                       cwd=REPO, check=True)
    levels = json.loads(report.read_text())["levels"]
    return {str(r["concurrency"]): {key: r[key] for key in ("throughput_tok_s", "ttft_p50_s", "itl_p50_s",
                                                            "tpot_p50_s", "acceptance_length", "errors",
                                                            "completed")} for r in levels}


def table(result: dict) -> str:
    lines = ["| concurrency | in replica tok/s | front door deployment tok/s | split / in replica | TTFT p50 ms "
             "(in replica / split) | ITL p50 ms (in replica / split) |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for level in map(str, LEVELS):
        a, b = result["in_replica"][level], result["deployment"][level]
        lines.append(f"| {level} | {a['throughput_tok_s']:.1f} | {b['throughput_tok_s']:.1f} | "
                     f"{b['throughput_tok_s'] / a['throughput_tok_s']:.2f}x | {a['ttft_p50_s'] * 1e3:.0f} / "
                     f"{b['ttft_p50_s'] * 1e3:.0f} | {a['itl_p50_s'] * 1e3:.0f} / {b['itl_p50_s'] * 1e3:.0f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for i, mode in enumerate(MODES):
        values = [result[mode][str(level)]["throughput_tok_s"] for level in LEVELS]
        ax.bar([x + 0.38 * i for x in range(len(LEVELS))], values, width=0.36,
               label={"in_replica": "API in the replica", "deployment": "front door deployment"}[mode])
    ax.set_xticks([x + 0.19 for x in range(len(LEVELS))], [f"concurrency {level}" for level in LEVELS])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"front door split, {result['requests']} requests x {result['max_tokens']} tokens, greedy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--work", default=str(REPO / "out" / "front-door-split"))
    parser.add_argument("--out", default="front-door-split.json")
    parser.add_argument("--plot", default="front-door-split.png")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    config = load_engine_config(args.config)
    if "DSPARK_CACHE" in config.target.path:
        prepare_target()
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in round_robin(DATASETS, args.requests)))
    result = {"machine": machine(), "requests": args.requests, "max_tokens": args.max_tokens,
              "backend": config.engine.backend}
    for mode in MODES:
        result[mode] = run_mode(Path(args.config), mode, work, prompts_file, args.requests, args.max_tokens)
    result["markdown"] = table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(args.plot))
    print(result["markdown"])
    print(f"backend {result['backend']}; {result['machine']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
