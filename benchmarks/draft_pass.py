"""The draft pass alone: the shipped head's ``DSparkDrafter.draft`` by rows drafted, greedy and sampled, one run.

What the draft gate's ``d(R)`` and the step's time split are made of: the head over a 200-token context per row
(committed as the target would commit it), one block of ``block_size`` per row, the embedded default's prefilter
(``draft_top_k``) and dtype. Median of ``--repeats`` calls per cell, each after one more committed position, beside
the native target's plain step for as many tokens (its cost profile, measured in the same run).

    python -m benchmarks.draft_pass [--rows 1,4,8] [--repeats 20] [--out draft_pass.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.report import REPO, machine
from dspark.builder import build_engine
from dspark.decoding.drafter import DraftInputs
from dspark.decoding.sampling import SamplingTensors
from dspark.schema import load_engine_config
from dspark.training.prepare import prepare_target

CONTEXT = 200


def draft_ms(drafter, rows: int, temperature: float, repeats: int) -> float:
    width = drafter.model.fc.in_features
    dtype = drafter.model.fc.weight.dtype
    ids = list(range(10_000, 10_000 + rows))
    gen = torch.Generator().manual_seed(0)
    for rid in ids:
        drafter.start_sequence(rid, CONTEXT + repeats + 64)
        drafter.commit([rid], [CONTEXT], torch.randn(CONTEXT, width, generator=gen).to(dtype))
    times = []
    for step in range(repeats):
        sampling = SamplingTensors(torch.full((rows,), temperature), torch.full((rows,), 0.95 if temperature else 1.0),
                                   torch.zeros(rows, dtype=torch.long),
                                   [torch.Generator().manual_seed(i) for i in range(rows)])
        inputs = DraftInputs(ids, torch.full((rows,), 42), torch.full((rows,), CONTEXT + step))
        start = time.perf_counter()
        drafter.draft(inputs, sampling)
        times.append(time.perf_counter() - start)
        for rid in ids:
            drafter.commit([rid], [1], torch.randn(1, width, generator=gen).to(dtype))
    for rid in ids:
        drafter.release_sequence(rid)
    return 1e3 * sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="draft_pass.json")
    args = parser.parse_args(argv)
    config = load_engine_config(Path(args.config))
    if "DSPARK_CACHE" in config.target.path:
        prepare_target()
    config = config.model_copy(update={"engine": config.engine.model_copy(update={"backend": "native"})})
    # the native engine binds the head to the target as the served paths do
    engine = build_engine(config, backend="native")
    drafter = engine.drafter
    draft_ms(drafter, 1, 0.0, 3)  # warm-up
    rows = [int(r) for r in args.rows.split(",")]
    profile = engine.measure_profile()  # the baseline: the target's plain step for as many rows, this run
    report = {"machine": machine(), "dtype": str(drafter.model.fc.weight.dtype).removeprefix("torch."),
              "block_size": drafter.block_size, "prefilter_k": drafter.prefilter_k, "context": CONTEXT, "cells": []}
    for r in rows:
        for label, temperature in (("greedy", 0.0), ("T=1 top-p 0.95", 1.0)):
            ms = draft_ms(drafter, r, temperature, args.repeats)
            plain_ms = 1e3 * float(profile.round_seconds(torch.tensor([r]))[0] - profile.draft_seconds)
            report["cells"].append({"rows": r, "sampling": label, "ms": ms, "plain_target_step_ms": plain_ms})
            print(f"[draft_pass] rows {r}, {label}: {ms:.2f} ms", flush=True)
    lines = [f"The draft pass, {report['dtype']}, block {report['block_size']}, prefilter {report['prefilter_k']}, "
             f"{CONTEXT}-token context per row; {report['machine']}", "",
             "| rows | sampling | ms per pass | native target's plain step (ms, as many tokens) | draft / step |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {c['rows']} | {c['sampling']} | {c['ms']:.2f} | {c['plain_target_step_ms']:.2f} | "
              f"{c['ms'] / c['plain_target_step_ms']:.2f}x |" for c in report["cells"]]
    report["markdown"] = "\n".join(lines)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
