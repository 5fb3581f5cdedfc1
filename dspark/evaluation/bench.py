"""``dspark bench``: acceptance and speed of speculation against plain decoding, in one run.

Each prompt's first turn goes through the target's chat template and the engine at batch 1, as the seeds measured.
The engine is the one ``serve run`` serves (``dspark.builder``: vLLM with our proposer on the embedded default;
``--backend native`` the reference engine), named in the JSON with its dtypes and proposer. Per benchmark:
completion tokens, verify steps, acceptance length in both definitions, per-position acceptance, an acceptance
histogram and tokens/s; the same prompts are also decoded without speculation by the same engine (fp32 and bf16
targets; the faster is the baseline) so the speed-up is measured side by side on the same machine in the same run.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from dspark.builder import build_engine
from dspark.config import SamplingParams
from dspark.decoding.engine import Engine
from dspark.decoding.metrics import SpecMetrics
from dspark.evaluation.prompt_sets import read_prompts
from dspark.loader import encode_prompt
from dspark.schema import EngineFileConfig


def run_prompts(engine: Engine, prompts: list[list[int]], params: SamplingParams, progress: str = "") -> dict:
    """Decode prompts one at a time (batch 1); returns pooled metrics, each request's summary (what the
    server returns with a response), seconds and the time split."""
    metrics, requests = SpecMetrics(), []
    engine.timings = dict.fromkeys(engine.timings, 0.0)
    seconds = 0.0
    for i, ids in enumerate(prompts):
        start = time.perf_counter()
        rid = engine.add_request(ids, replace(params, seed=None if params.seed is None else params.seed + i))
        while engine.has_unfinished():
            engine.step()
        seconds += time.perf_counter() - start
        finished = engine.result(rid).metrics
        metrics = metrics.merge(finished)
        requests.append(finished.request_summary())
        if progress:
            print(f"\r[bench] {progress} {i + 1}/{len(prompts)} prompts, {metrics.completion_tokens} tokens, "
                  f"{metrics.completion_tokens / max(seconds, 1e-9):.1f} tok/s", end="", flush=True)
    if progress:
        print(flush=True)
    return {"metrics": metrics, "requests": requests, "seconds": seconds, "timings": dict(engine.timings)}


def summarise(run: dict, prompts: int) -> dict:
    m: SpecMetrics = run["metrics"]
    return {
        "prompts": prompts,
        "completion_tokens": m.completion_tokens,
        "verify_steps": m.verify_steps,
        "num_drafts": m.num_drafts,
        "num_draft_tokens": m.num_draft_tokens,
        "num_drafted_tokens": m.num_drafted_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "acceptance_length_pooled": m.acceptance_length,
        "acceptance_length_per_request": m.acceptance_length_per_request,
        "acceptance_rate_per_pos": m.acceptance_rate_per_pos,
        "acceptance_histogram": m.acceptance_histogram,
        "draft_skips": m.draft_skips,
        "drafted_round_share": m.num_drafts / max(m.verify_steps - prompts, 1),  # decode rounds with a draft
        "seconds": run["seconds"],
        "tokens_per_s": m.completion_tokens / max(run["seconds"], 1e-9),
        "time_split_s": run["timings"],
        "requests": run.get("requests", []),
    }


def markdown_table(results: dict, block: int) -> str:
    lines = [f"| Benchmark | Prompts | Max tokens | Acceptance length | Accept rate, positions 1-{block} | "
             "Drafted rounds | Spec tok/s | Plain tok/s | Speed-up |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for name, r in results["benchmarks"].items():
        spec, base = r["speculative"], r["baseline"]
        rates = " ".join(f"{x:.2f}" for x in spec["acceptance_rate_per_pos"][:block])
        lines.append(f"| {name} | {spec['prompts']} | {results['max_tokens']} | "
                     f"{spec['acceptance_length_pooled']:.3f} | {rates} | {spec['drafted_round_share']:.0%} | "
                     f"{spec['tokens_per_s']:.1f} | "
                     f"{base['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    pooled = results["pooled"]
    rates = " ".join(f"{x:.2f}" for x in pooled["acceptance_rate_per_pos"][:block])
    lines.append(f"| **Pooled** | {pooled['prompts']} | | **{pooled['acceptance_length_pooled']:.3f}** | {rates} | "
                 f"{pooled['drafted_round_share']:.0%} | {pooled['tokens_per_s']:.1f} | "
                 f"{pooled['baseline_tokens_per_s']:.1f} | {pooled['speedup']:.2f}x |")
    engine = results.get("engine")
    if engine:
        lines += ["", "Engine: " + ", ".join(f"{k} {v}" for k, v in engine.items()) + "."]
    target = results.get("dtypes", {}).get("target")
    if target:
        plain = ", ".join(f"{d} {v:.1f} tok/s" for d, v in results.get("plain_by_dtype", {}).items())
        ratio = results.get("chosen_dtype_vs_fastest_plain")
        lines += ["", f"Dtype: {target['dtype']} ({target['reason']}). Plain decoding, pooled: {plain}"
                  + (f"; the chosen dtype runs at {ratio:.2f}x the fastest." if ratio is not None else ".")]
    return "\n".join(lines)


def plot_acceptance(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results["benchmarks"].items():
        spec = r["speculative"]
        rates = spec["acceptance_rate_per_pos"]
        label = f"{name} (τ={spec['acceptance_length_pooled']:.2f})"
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / drafts)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{results['model']}: per-position acceptance, T={results['temperature']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(cfg: EngineFileConfig, datasets: list[Path], limit: int | None, max_tokens: int, temperature: float,
              top_p: float, block_size: int | None, baseline_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
              seed: int = 0, backend: str | None = None) -> dict:
    """The configured engine (``backend`` overrides ``engine.backend``) against plain decoding of the same engine in
    each of ``baseline_dtypes``, on the same prompts, one engine at a time (each built by ``dspark.builder``, run
    over every dataset, shut down). On the vLLM backend the baselines run on the kernels the served engine runs on
    (shape-invariant or vLLM's own: they are installed once per process)."""
    if block_size is not None:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"block_size": block_size})})
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    spec_engine = build_engine(cfg, backend=backend)
    tok, description, dtypes = spec_engine.tokenizer, spec_engine.description, spec_engine.dtypes
    block = cfg.engine.block_size if description["backend"] == "vllm" else spec_engine.block_size
    prompt_sets = {path.stem: [encode_prompt(tok, p, chat=True)[-(cfg.engine.max_model_len - max_tokens - 1):]
                               for p in read_prompts(path, limit)] for path in datasets}
    spec_runs = {name: run_prompts(spec_engine, prompts, params, f"{name} speculative")
                 for name, prompts in prompt_sets.items()}
    spec_engine.shutdown()
    del spec_engine
    base_runs: dict[str, dict] = {}  # dtype -> dataset -> run
    baselines: dict[str, dict] = {}
    for d in baseline_dtypes:
        engine = build_engine(cfg.model_copy(update={"target": cfg.target.model_copy(update={"dtype": d})}),
                              speculate=False, backend=backend)
        baselines[d] = engine.description
        base_runs[d] = {name: run_prompts(engine, prompts, params, f"{name} plain {d}")
                        for name, prompts in prompt_sets.items()}
        engine.shutdown()
        del engine  # gone before the next one is built
    results: dict = {"model": cfg.name, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
                     "block_size": block, "engine": description, "baseline_engines": baselines,
                     "dtypes": dtypes, "benchmarks": {}}
    pooled, pooled_base_s, pooled_spec_s = SpecMetrics(), 0.0, 0.0
    for name, prompts in prompt_sets.items():
        spec = spec_runs[name]
        runs = {d: base_runs[d][name] for d in baseline_dtypes}
        best = max(runs, key=lambda d: summarise(runs[d], len(prompts))["tokens_per_s"])
        s_spec, s_base = summarise(spec, len(prompts)), summarise(runs[best], len(prompts))
        s_base["dtype"] = best
        results["benchmarks"][name] = {
            "speculative": s_spec, "baseline": s_base,
            "baseline_all": {d: summarise(r, len(prompts))["tokens_per_s"] for d, r in runs.items()},
            "speedup": s_spec["tokens_per_s"] / max(s_base["tokens_per_s"], 1e-9),
        }
        pooled = pooled.merge(spec["metrics"])
        pooled_spec_s += spec["seconds"]
        pooled_base_s += runs[best]["seconds"]
    base_tokens = sum(r["baseline"]["completion_tokens"] for r in results["benchmarks"].values())
    summary = summarise({"metrics": pooled, "seconds": pooled_spec_s, "timings": {}},
                        sum(r["speculative"]["prompts"] for r in results["benchmarks"].values()))
    summary["baseline_tokens_per_s"] = base_tokens / max(pooled_base_s, 1e-9)
    summary["speedup"] = summary["tokens_per_s"] / max(summary["baseline_tokens_per_s"], 1e-9)
    results["pooled"] = summary
    results["plain_by_dtype"] = plain = {
        d: sum(r["metrics"].completion_tokens for r in base_runs[d].values())
        / max(sum(r["seconds"] for r in base_runs[d].values()), 1e-9) for d in baseline_dtypes}
    chosen = dtypes.get("target", {}).get("dtype")
    if chosen in plain:  # how the dtype the config chose decodes against the fastest one measured here
        results["chosen_dtype_vs_fastest_plain"] = plain[chosen] / max(plain.values())
    return results
