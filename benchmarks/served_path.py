"""The served path against the in-process engine, side by side in one run (concurrency 1).

The same prompts, the same greedy settings, speculation on and off:
  * ``in-process``: ``dspark bench``'s loop (``dspark.evaluation.bench.run_prompts``), one request at a time;
  * ``served``: ``serve run`` of the same config (HTTP, the OpenAI chat API, streaming), driven by
    ``dspark loadtest`` at concurrency 1.
The load-aware switch is off in the served copy (the in-process engine has none), so both paths
run the same algorithm: schedule -> draft gate -> draft -> prefix -> verify -> commit.
A third column runs the in-process engine again while the served application sits idle beside it:
on a 2-core machine Ray's and Serve's control plane (about 2,000 thread wake-ups a second, idle)
interrupts the two OpenMP threads of a target pass, and this column says how much of the gap is
that presence rather than the served path's own work.

    python -m benchmarks.served_path [--config configs/embedded.yaml] [--prompts 30] [--max-tokens 128]
        [--out served_path.json] [--plot served_path.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.report import DATASETS, REPO, SERVE_CONFIG, Served, _bin, machine
from dspark.builder import build_engine
from dspark.config import SamplingParams
from dspark.evaluation.bench import run_prompts
from dspark.evaluation.prompt_sets import round_robin
from dspark.loader import encode_prompt
from dspark.schema import load_engine_config, write_variant
from dspark.training.prepare import prepare_target


def in_process(config, texts: list[str], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rows = {}
    for mode, speculate in (("on", True), ("off", False)):
        engine = build_engine(config, speculate=speculate, backend="native")
        prompts = [encode_prompt(engine.tokenizer, t, chat=True) for t in texts]
        run = run_prompts(engine, prompts, params, f"in-process speculation {mode}")
        m = run["metrics"]
        rows[mode] = {"tokens": m.completion_tokens, "seconds": run["seconds"],
                      "tok_s": m.completion_tokens / run["seconds"], "dtypes": engine.dtypes,
                      "acceptance_length": m.completion_tokens / max(m.verify_steps, 1)}
    return rows


def served(config_path: Path, out: Path, prompts_file: Path, texts: list[str], max_tokens: int) -> tuple[dict, dict]:
    """The served path's figures, and the in-process engine's measured while the served application idles."""
    variant = write_variant(load_engine_config(config_path), out / "served-path.json",  # the native path, as in process
                            engine={"backend": "native"}, serving={"load_aware_speculation": False})
    serve_yaml = out / "serve-served-path.yaml"
    serve_yaml.write_text(SERVE_CONFIG.format(config=variant))
    report = out / "served-path-load.json"
    with Served(serve_yaml, out / "serve-served-path.log"):
        subprocess.run([_bin("dspark"), "loadtest", "--dataset", str(prompts_file), "--concurrency", "1",
                        "--requests", str(len(texts)), "--max-tokens", str(max_tokens), "--temperature", "0",
                        "--top-p", "1.0", "--modes", "on,off", "--out", str(report)], cwd=REPO, check=True)
        beside = in_process(load_engine_config(config_path), texts, max_tokens)
    levels = json.loads(report.read_text())["levels"]
    return beside, {r["speculation"]: {"tokens": r["output_tokens"], "seconds": r["wall_s"],
                                       "tok_s": r["throughput_tok_s"], "acceptance_length": r["acceptance_length"],
                                       "errors": r["errors"]} for r in levels}


def table(result: dict) -> str:
    lines = ["| speculation | in-process tok/s | served (HTTP) tok/s | served / in-process | in-process beside the "
             "idle served app, tok/s | served / that | τ in-process | τ served |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode in ("on", "off"):
        a, b, c = result["in_process"][mode], result["served"][mode], result["in_process_beside_served"][mode]
        lines.append(f"| {mode} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | {b['tok_s'] / a['tok_s']:.2f}x | "
                     f"{c['tok_s']:.1f} | {b['tok_s'] / c['tok_s']:.2f}x | "
                     f"{a['acceptance_length']:.2f} | {(b['acceptance_length'] or 0):.2f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    modes = ["on", "off"]
    for i, (key, label) in enumerate((("in_process", "in-process engine"), ("served", "served (HTTP, Ray)"),
                                      ("in_process_beside_served", "in-process, idle served app beside"))):
        values = [result[key][m]["tok_s"] for m in modes]
        ax.bar([x + 0.27 * i for x in range(len(modes))], values, width=0.25, label=label)
    ax.set_xticks([x + 0.27 for x in range(len(modes))], [f"speculation {m}" for m in modes])
    ax.set_ylabel("output tokens/s, concurrency 1")
    ax.set_title(f"{result['prompts']} prompts x {result['max_tokens']} tokens, greedy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--work", default=str(REPO / "out" / "served-path"), help="folder for configs and logs")
    parser.add_argument("--out", default="served_path.json")
    parser.add_argument("--plot", default="served_path.png")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    config = load_engine_config(args.config)
    if "DSPARK_CACHE" in config.target.path:
        prepare_target()
    texts = round_robin(DATASETS, args.prompts)
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    result = {"machine": machine(), "prompts": len(texts), "max_tokens": args.max_tokens,
              "in_process": in_process(config, texts, args.max_tokens)}
    result["in_process_beside_served"], result["served"] = served(Path(args.config), work, prompts_file, texts,
                                                                  args.max_tokens)
    result["markdown"] = table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(args.plot))
    print(result["markdown"])
    print(f"dtypes: {result['in_process']['on']['dtypes']}; {result['machine']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
