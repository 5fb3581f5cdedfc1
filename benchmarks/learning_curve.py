"""Learning curves of DSpark training runs: held-out tau and position-1 acceptance against anchors trained.

Each run's ``curve.jsonl`` (written by ``dspark train`` with ``train.eval_every``; see
``dspark.training.trainer.LearningCurve``) is one line per point. A power law ``tau - 1 = a * anchors^b`` fitted to
each run's later half gives an extrapolated budget for a target tau (by default the seeds' release, 3.45). A power
law does not saturate, so the budget it gives is a lower bound: real curves bend over as the head's capacity or the
data run out.

    python -m benchmarks.learning_curve --run dspark=PATH/curve.jsonl --run control=PATH/curve.jsonl
        [--goal 3.45] [--out curve.json] [--plot curve.png]

The distillation's curve (``dspark train --resume``: one line per point with every head trained beside the DSpark
head) is read with ``--distill training/smollm2-135m-dspark/curve.jsonl``; its x axis is tokens of text read.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dspark.jsonl import read_jsonl


def read_curve(path: Path) -> list[dict]:
    return read_jsonl(path)


def distill_runs(path: Path) -> dict[str, list[dict]]:
    """The distillation's curve (every head on one line) as one run per head, x = tokens of text read (in the
    ``anchors`` field the rest of this module reads)."""
    runs: dict[str, list[dict]] = {}
    for point in read_jsonl(path):
        for name, head in point["heads"].items():
            runs.setdefault(name, []).append({
                "step": point["step"], "anchors": point["tokens_read"], "seconds": point["train_seconds"],
                "block_size": len(head["acceptance_per_pos"]), "heldout_tau": head["tau"],
                "heldout_acceptance_per_pos": head["acceptance_per_pos"]})
    return runs


def power_law(points: list[dict]) -> dict | None:
    """Least squares of log(tau - 1) on log(anchors) over the later half of the points (anchors > 0)."""
    pts = [(math.log(p["anchors"]), math.log(p["heldout_tau"] - 1)) for p in points
           if p["anchors"] > 0 and p["heldout_tau"] > 1]
    pts = pts[len(pts) // 2:]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return {"a": math.exp(my - b * mx), "b": b, "points": len(pts)}


def anchors_for(fit: dict | None, tau: float) -> float | None:
    if fit is None or fit["b"] <= 0:
        return None
    return ((tau - 1) / fit["a"]) ** (1 / fit["b"])


def summarise(runs: dict[str, list[dict]], goal: float) -> dict:
    out = {}
    for name, points in runs.items():
        last, fit = points[-1], power_law(points)
        # a block of gamma drafts can reach at most tau = 1 + gamma (the gamma = 1 control: 2)
        need = anchors_for(fit, goal) if goal < 1 + last["block_size"] else None
        per_anchor_s = last["seconds"] / last["anchors"] if last["anchors"] and last["seconds"] else None
        out[name] = {"steps": last["step"], "anchors": last["anchors"], "block_size": last["block_size"],
                     "heldout_tau": last["heldout_tau"], "acc1": last["heldout_acceptance_per_pos"][0],
                     "start_tau": points[0]["heldout_tau"], "fit": fit, "goal": goal, "anchors_for_goal": need,
                     "hours_for_goal_here": need * per_anchor_s / 3600 if need and per_anchor_s else None}
    return out


def plot(runs: dict[str, list[dict]], summary: dict, path: Path, x_label: str = "anchors trained (block starts)"
         ) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in runs.items():
        pts = [p for p in points if p["anchors"] > 0]
        xs = [p["anchors"] for p in pts]
        left.plot(xs, [p["heldout_tau"] for p in pts], marker="o", label=f"{name} (gamma {pts[-1]['block_size']})")
        right.plot(xs, [p["heldout_acceptance_per_pos"][0] for p in pts], marker="o", label=name)
        fit = summary[name]["fit"]
        if fit is not None:
            grid = [xs[0] * (xs[-1] * 10 / xs[0]) ** (i / 40) for i in range(41)]
            left.plot(grid, [1 + fit["a"] * x ** fit["b"] for x in grid], ls=":", color="grey")
    for ax, label in ((left, "held-out tau (full blocks, analytic)"), (right, "held-out position-1 acceptance")):
        ax.set_xscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    left.set_title("tau against training (dotted: power-law fit, extrapolated 10x)")
    right.set_title("position 1: a DSpark block against a next-token control")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", default=[], help="NAME=PATH of a curve.jsonl")
    ap.add_argument("--distill", type=Path, help="the distillation's curve.jsonl (every head, x: tokens read)")
    ap.add_argument("--goal", type=float, default=3.45, help="tau to extrapolate the budget for")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    runs = distill_runs(args.distill) if args.distill else {}
    if not runs and not args.run:
        ap.error("give --run NAME=PATH or --distill PATH")
    for item in args.run:
        name, _, path = item.partition("=")
        if not path:
            ap.error(f"--run {item!r}: expected NAME=PATH")
        runs[name] = read_curve(Path(path))
    summary = summarise(runs, args.goal)
    print(f"{'run':10} {'gamma':>5} {'steps':>6} {'anchors':>9} {'tau start':>9} {'tau':>6} {'acc1':>6} "
          f"{'fit b':>6} {'anchors for ' + str(args.goal):>17} {'hours here':>10}")
    for name, s in summary.items():
        fit_b = f"{s['fit']['b']:.3f}" if s["fit"] else "-"
        need = f"{s['anchors_for_goal']:.3g}" if s["anchors_for_goal"] else "-"
        hours = f"{s['hours_for_goal_here']:.3g}" if s["hours_for_goal_here"] else "-"
        print(f"{name:10} {s['block_size']:5d} {s['steps']:6d} {s['anchors']:9d} {s['start_tau']:9.3f} "
              f"{s['heldout_tau']:6.3f} {s['acc1']:6.3f} {fit_b:>6} {need:>17} {hours:>10}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        plot(runs, summary, args.plot, "tokens of text read" if args.distill else "anchors trained (block starts)")


if __name__ == "__main__":
    main()
