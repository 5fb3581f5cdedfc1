"""The Ray path against the in-process engine, side by side in one run.

For each concurrency level (requests decoded together) it runs the same prompts through
  * ``in-process``: ``dspark.decoding.engine.Engine`` in this process (target + drafter, no Ray);
  * ``ray``: the router over a target shard actor and a drafter actor (``pipeline: false``);
  * ``ray+pipeline``: the same with two micro-batches overlapping draft and verify;
and prints output tokens/s, the ratio to in-process, acceptance length, and the per-step time
split: target compute, draft compute, feature transport (both ends), and the router's own
time (scheduling, batching, Ray calls: step time minus the waits for the actors). Greedy
outputs of every variant are checked against the in-process engine's.

    python -m benchmarks.ray_runtime [--config configs/embedded.yaml] [--concurrency 1,8]
        [--requests-per-level 8] [--max-tokens 64] [--out ray_runtime.json] [--plot ray_runtime.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import ray
import torch

from actors.router import Router
from dspark.builder import build_engine
from dspark.config import ConfigError, SamplingParams
from dspark.evaluation.prompt_sets import round_robin
from dspark.loader import encode_prompt
from dspark.schema import load_engine_config
from dspark.training.prepare import prepare_target

REPO = Path(__file__).resolve().parents[1]
DATASETS = ("humaneval", "mbpp", "gsm8k", "mt-bench")


def run_level(engine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    """Decode ``prompts`` keeping at most ``concurrency`` in flight; tokens/s and outputs."""
    start = time.perf_counter()
    outputs, pending = {}, list(enumerate(prompts))
    active: dict[int, int] = {}
    while pending or active:
        while pending and len(active) < concurrency:
            index, prompt = pending.pop(0)
            active[engine.add_request(prompt, params)] = index
        for out in engine.step():
            if out.finished:
                index = active.pop(out.request_id)
                outputs[index] = engine.result(out.request_id)
    seconds = time.perf_counter() - start
    results = [outputs[i] for i in range(len(prompts))]
    tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.metrics.verify_steps for r in results)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "acceptance_length": tokens / max(steps, 1), "token_ids": [r.token_ids for r in results]}


def split(engine, before: dict, stats_before: dict | None, stats_after: dict | None, steps: int) -> dict:
    """Per-step milliseconds: target, draft, transport, router (what the router did besides waiting)."""
    t = {k: engine.timings[k] - before[k] for k in before}
    out = {"step": t["step"], "router": t["step"] - t["draft"] - t["verify"]}
    if stats_after is None:  # in process: the waits are the compute
        out.update(target=t["verify"], draft=t["draft"], transport=0.0)
    else:
        delta = {k: stats_after[k] - stats_before[k] for k in stats_after}
        out.update(target=delta["run_seconds"], draft=delta["draft_seconds"], transport=delta["transport"])
        out["router"] += max(t["verify"] - delta["run_seconds"], 0)  # Ray call overhead on the verify path
    return {k: 1000 * v / max(steps, 1) for k, v in out.items()}


def actor_seconds(router: Router) -> dict:
    sender = ray.get(router.shards[0].stats.remote())
    receiver = ray.get(router.drafter.actor.stats.remote())
    return {"run_seconds": sender["run_seconds"], "draft_seconds": receiver["draft_seconds"],
            "transport": sender["channel"]["seconds"] + receiver["channel"]["seconds"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests-per-level", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--pipeline-shard-threads", type=int, default=0, help="default: all cores")
    parser.add_argument("--pipeline-drafter-threads", type=int, default=0, help="default: half the cores")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    try:
        config = load_engine_config(args.config)
        levels = [int(c) for c in args.concurrency.split(",")]
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "DSPARK_CACHE" in config.target.path:
        prepare_target()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=0.95, seed=0)
    engine = build_engine(config, backend="native")
    prompts = [encode_prompt(engine.tokenizer, t, chat=True)
               for t in round_robin(DATASETS, args.requests_per_level)]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    variants = {"in-process": None, "ray": False, "ray+pipeline": True}
    rows = []
    print(f"{'variant':>14} {'conc':>4} {'tok/s':>7} {'vs in-proc':>10} {'tau':>5} | per step ms: "
          f"{'target':>7} {'draft':>6} {'transport':>9} {'router':>6}  same-output", flush=True)
    for name, pipeline in variants.items():
        runner, router = engine, None
        if pipeline is not None:
            torch.set_num_threads(config.runtime.router_threads)  # as in a Serve replica: the router only batches
            # pipelined actors compute at the same time: the drafter gets a share of the cores, the target the rest
            cores = os.cpu_count() or 2
            threads = ({"shard_threads": args.pipeline_shard_threads or cores,
                        "drafter_threads": args.pipeline_drafter_threads or max(cores // 2, 1)} if pipeline else {})
            runtime = config.runtime.model_copy(update={"pipeline": pipeline, **threads})
            router = runner = Router(config.model_copy(update={"runtime": runtime}))
        try:
            for level in levels:
                before = dict(runner.timings)
                stats_before = actor_seconds(router) if router else None
                steps_before = runner.num_steps
                row = run_level(runner, prompts, params, level)
                steps = runner.num_steps - steps_before
                stats_after = actor_seconds(router) if router else None
                row.update(variant=name, concurrency=level,
                           split_ms=split(runner, {k: before[k] for k in ("draft", "verify", "schedule", "step")},
                                          stats_before, stats_after, steps))
                base = next((r for r in rows if r["variant"] == "in-process" and r["concurrency"] == level), row)
                row["ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["same_output"] = row["token_ids"] == base["token_ids"]
                rows.append(row)
                s = row["split_ms"]
                print(f"{name:>14} {level:>4} {row['tokens_per_s']:7.1f} {row['ratio']:9.2f}x "
                      f"{row['acceptance_length']:5.2f} | {'':12} {s['target']:7.1f} {s['draft']:6.1f} "
                      f"{s['transport']:9.2f} {s['router']:6.1f}  {row['same_output']}", flush=True)
        finally:
            if router is not None:
                router.shutdown()
    ray.shutdown()
    print("\nper step = per engine step; router = step time not spent waiting for the actors' compute")
    if args.out:
        Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
                                             indent=1))
    if args.plot:
        plot(rows, levels, args.plot)
    return 0


def plot(rows: list[dict], levels: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next(r["tokens_per_s"] for r in rows if r["variant"] == name and r["concurrency"] == c)
                  for c in levels]
        ax.bar([j + i * width for j in range(len(levels))], values, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))], [f"concurrency {c}" for c in levels])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Ray path vs in-process engine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
