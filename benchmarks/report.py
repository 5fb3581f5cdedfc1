"""Regenerate docs/performance.md and its figures in one run (``make report``).

    python -m benchmarks.report [--limit 8] [--max-tokens 128] [--baseline-dtypes float32,bfloat16]
                                [--load-requests 8] [--concurrency 1,4,8] [--soak-seconds 120]
                                [--out-dir docs/figures] [--skip bench,peers,load]

Steps, each printing progress: (1) ``dspark bench`` on four prompt sets at temperature 0 and 1.0 /
top-p 0.95 (acceptance table in the seeds' format + speed against plain decoding); (2) the peers
(``benchmarks.peers``: vLLM plain and prompt lookup, native plain and DSpark, transformers generate);
(3) ``serve run`` of the embedded default with the load-aware switch both off and on, and ``dspark
loadtest`` over HTTP at each concurrency for speculation on and off; (4) a soak with cancellations.
Every figure lands in ``--out-dir``; the Markdown is written from those JSON files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch

REPO = Path(__file__).resolve().parents[1]
DATASETS = ("humaneval", "mbpp", "gsm8k", "mt-bench")
SERVE_CONFIG = """proxy_location: EveryNode
http_options: {{host: 127.0.0.1, port: 8000}}
grpc_options:
  port: 9000
  grpc_servicer_functions:
    - dspark.v1.serving_pb2_grpc.add_DSparkServicer_to_server
    - grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server
applications:
  - name: dspark
    route_prefix: /
    import_path: deploy.ray_app:build_app
    args: {{config: {config}}}
"""


def _run(cmd: list[str], **kw) -> None:
    print(f"[report] $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, **kw)


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def bench(out: Path, limit: int, max_tokens: int, baseline_dtypes: str) -> dict:
    results = {}
    for label, temperature, top_p in (("greedy", 0.0, 1.0), ("t1", 1.0, 0.95)):
        path = out / f"bench-{label}.json"
        _run([_bin("dspark"), "bench", "--config", "configs/embedded.yaml", "--limit", str(limit),
              "--max-tokens", str(max_tokens), "--temperature", str(temperature), "--top-p", str(top_p),
              "--baseline-dtypes", baseline_dtypes, "--threads", "2",
              "--out", str(path), "--plot", str(out / f"acceptance-{label}.png"),
              *sum((["--dataset", d] for d in DATASETS), [])])
        results[label] = json.loads(path.read_text())
    return results


def served_config(out: Path, load_aware: bool) -> Path:
    from dspark.schema import load_engine_config, write_variant

    path = write_variant(load_engine_config(REPO / "configs" / "embedded.yaml"),
                         out / f"served-{'load-aware' if load_aware else 'always'}.json",
                         engine={"backend": "native"},  # this project's engine, as the in-process rows
                         serving={"load_aware_speculation": load_aware, "speculation_probe_interval_s": 30.0})
    serve_yaml = out / f"serve-{path.stem}.yaml"
    serve_yaml.write_text(SERVE_CONFIG.format(config=path))
    return serve_yaml


def on_cpus(cpus: set[int] | None):
    """A ``preexec_fn`` that starts a child process on ``cpus`` (None: no change)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


class Served:
    """``serve run`` in the background for the duration of a ``with`` block."""

    def __init__(self, serve_yaml: Path, log: Path, cpus: set[int] | None = None):
        """``cpus``: the cores ``serve run`` and everything it starts (Ray's and Serve's processes, the replica) run
        on; None: this process's."""
        self.serve_yaml, self.log, self.cpus = serve_yaml, log, cpus

    def __enter__(self):
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen([_bin("serve"), "run", str(self.serve_yaml)], cwd=REPO, env=env,
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     preexec_fn=on_cpus(self.cpus))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if requests.get("http://127.0.0.1:8000/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited; see {self.log}")
            time.sleep(2)
        raise RuntimeError("the server did not come up in 10 minutes")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        subprocess.run([_bin("ray"), "stop", "--force"], cwd=REPO, capture_output=True)


def load(out: Path, concurrency: str, requests_per_level: int, max_tokens: int) -> dict:
    results = {}
    for load_aware in (False, True):
        label = "load-aware" if load_aware else "always"
        with Served(served_config(out, load_aware), out / f"serve-{label}.log"):
            for temperature, tag in ((0.0, "greedy"), (1.0, "t1")):
                path = out / f"load-{label}-{tag}.json"
                subprocess.run([_bin("dspark"), "loadtest", "--dataset", "mt-bench",
                                "--concurrency", concurrency, "--requests", str(requests_per_level),
                                "--max-tokens", str(max_tokens), "--temperature", str(temperature),
                                "--top-p", "0.95" if temperature else "1.0", "--out", str(path),
                                "--plot", str(out / f"load-{label}-{tag}.png")], cwd=REPO, check=False)
                results[f"{label}-{tag}"] = json.loads(path.read_text())
            if not load_aware:
                from benchmarks.soak import run as soak

                results["soak"] = soak("http://127.0.0.1:8000", SOAK_SECONDS, workers=3, max_tokens=32)
                (out / "soak.json").write_text(json.dumps(results["soak"], indent=1))
    return results


SOAK_SECONDS = 120.0


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}, {platform.system()} {platform.release()}")


def reused(out: Path, bench_results: dict, skip: str) -> str:
    """Where the figures of the steps this run did not measure come from."""
    steps = [s for s in skip.split(",") if s]
    if not steps:
        return ""
    where = f"`{os.path.relpath(out, REPO)}`"
    text = f" Steps `{','.join(steps)}` were not re-measured by this run; their figures were read from {where}"
    if "bench" in steps:
        r = bench_results["greedy"]
        prompts = max(b["speculative"]["prompts"] for b in r["benchmarks"].values())
        text += (f" (the bench tables: `dspark bench` runs of {prompts} prompts x {r['max_tokens']} tokens per set, "
                 "with the head now shipped")
        text += "; the peers and load figures come from an earlier run, with an earlier head)" \
            if {"peers", "load"} & set(steps) else ")"
    return text + "."


def served_section(out: Path) -> list[str]:
    """The served path against the in-process engine (``make bench-served`` writes served_path.json)."""
    path = out / "served_path.json"
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    dtype = r["in_process"]["on"]["dtypes"]["target"]
    return ["## The served path against the in-process engine", "",
            f"`python -m benchmarks.served_path` ({r['prompts']} prompts x {r['max_tokens']} tokens, greedy, "
            f"concurrency 1, {dtype['dtype']}: {dtype['reason']}; {r['machine']}): `dspark bench`'s loop in process, "
            "then `serve run` of the same config driven over HTTP by `dspark loadtest`.", "", r["markdown"], "",
            "![served vs in-process](figures/served_path.png)", ""]


def render(out: Path, bench_results: dict, peers: dict, load_results: dict, args) -> str:
    from benchmarks.peers import table as peers_table
    from dspark.evaluation.bench import markdown_table
    from dspark.evaluation.loadtest import table as load_table

    rel = os.path.relpath(out, REPO / "docs")
    lines = [
        "# Performance report",
        "",
        f"Regenerated by `make report` (`python -m benchmarks.report {' '.join(sys.argv[1:])}`) on "
        f"{time.strftime('%Y-%m-%d')}. Machine: {machine()}. "
        + ("Ratios" if args.skip else "Every figure below comes from one run of that command; ratios")
        + " are measured side by side in the same run (the machine is shared and noisy)."
        + reused(out, bench_results, args.skip),
        "",
        "The target is the embedded default, SmolLM2-135M-Instruct, with the DSpark head this repository "
        "trains for it (`models/smollm2-135m-dspark`). On 2 CPU cores a 135M target costs about as much per "
        "token as the draft network, so the absolute speed-ups are far from what a 1T target on B300s sees; "
        "the point of these figures is that every number is measured and lossless, and where speculation "
        "loses, the system notices.",
        "",
        "## Acceptance (seeds' format), `dspark bench`",
        "",
    ]
    for label, title in (("greedy", "temperature 0"), ("t1", "temperature 1.0, top-p 0.95")):
        r = bench_results[label]
        lines += [f"### {title}", "", markdown_table(r, r["block_size"]), "",
                  f"![per-position acceptance]({rel}/acceptance-{label}.png)", ""]
    lines += ["## Peers on the same target", "",
              "vLLM (plain and with its prompt lookup), this project's native engine (plain and with the DSpark "
              "head), `transformers` generate; batch 1 and concurrency 8, greedy and T=1 (`python -m "
              "benchmarks.peers`):", "", peers_table(peers), "", f"![peers]({rel}/peers.png)", ""]
    lines += served_section(out)
    lines += ["## Under load: `dspark loadtest` (HTTP streaming, mt-bench prompts)", "",
              "Each level runs the same requests with speculation on and off (the `speculation: false` request "
              "extension) against the same server in the same run. *always*: speculation on for every request; "
              "*load-aware*: the per-replica switch turns drafting off while the measured acceptance length "
              "is below break-even and probes again every 30 s. *tau* here is the per-request definition "
              "(completion tokens / verify steps, prefill and rounds the scheduler trimmed to zero drafts "
              "included); the bench tables above use the pooled 1 + accepted / drafts.", ""]
    ratios = []
    for key, report in load_results.items():
        if key == "soak":
            continue
        levels = {(r["concurrency"], r["speculation"]): r for r in report["levels"]}
        worst = min((levels[(c, "on")]["throughput_tok_s"] / levels[(c, "off")]["throughput_tok_s"], c)
                    for c, mode in levels if mode == "on" and (c, "off") in levels)
        ratios.append(f"*{key}*: {worst[0]:.2f}x (at concurrency {worst[1]})")
    if ratios:
        lines += ["Lowest aggregate throughput with speculation on relative to plain decoding, over the levels: "
                  + "; ".join(ratios) + ".", ""]
    for key, report in load_results.items():
        if key == "soak":
            continue
        label, tag = key.rsplit("-", 1)
        lines += [f"### {label}, {'greedy' if tag == 'greedy' else 'temperature 1.0'}", "", load_table(report), "",
                  f"![throughput vs per-request speed]({rel}/load-{key}.png)", ""]
    lines += goals(bench_results, load_results)
    soak = load_results.get("soak")
    if soak:
        growth = max(soak["rss_growth_mib"].values()) if soak["rss_growth_mib"] else 0.0
        lines += ["## Soak", "",
                  f"{soak['duration_s']:.0f} s, {soak['workers']} workers, {soak['requests']} mixed requests "
                  f"(streaming, unary, abandoned mid-stream): outcomes {soak['outcomes']}; unanswered "
                  f"{len(soak['unanswered'])}, answered twice {len(soak['answered_more_than_once'])}, duplicate "
                  f"response ids {soak['duplicate_response_ids']}; KV blocks free after "
                  f"{soak['kv_free_after']}/{soak['kv_total']}; largest RSS growth of a DSpark process "
                  f"{growth:.1f} MiB (bound {soak['rss_bound_mib']:.0f} MiB). Verdict: "
                  f"{'pass' if soak['ok'] else 'FAIL'}. The 10-minute soak: "
                  "`python -m benchmarks.soak --duration 600` against a running server.", ""]
    lines += ["## Faults", "",
              "Fault handling is shown by tests on a live local cluster, not by this report "
              "(`pytest tests/test_faults.py tests/test_replica_isolation.py`, about 4 minutes): a drafter killed "
              "under load (every request completes, exactly the target's greedy output); a target shard killed "
              "mid-stream (HTTP 503 with `Retry-After`, an in-band `unavailable` event on streams, gRPC "
              "`UNAVAILABLE`; the replica restarts its actors and serves again); with two replicas, a shard "
              "killed on one (the other replica's streams finish untouched and exact, its actors keep their "
              "process ids); overload (429 / `RESOURCE_EXHAUSTED` at once, accepted requests complete); a "
              "client that stops reading (others unaffected); a soak with cancellations (above).", ""]
    return "\n".join(lines) + "\n"


def goals(bench_results: dict, load_results: dict) -> list[str]:
    """The issue's goals against what this run measured, and what limits the figures."""
    lines = ["## Goals and where they are missed", "",
             "| Goal | Measured |", "| --- | --- |"]
    for label, name, goal in (("greedy", "greedy", 2.0), ("t1", "temperature 1.0", 1.6)):
        pooled = bench_results[label]["pooled"]
        lines.append(f"| batch-1 speed-up, {name}: {goal:.1f}x (`dspark bench`) | {pooled['speedup']:.2f}x "
                     f"({pooled['tokens_per_s']:.1f} vs {pooled['baseline_tokens_per_s']:.1f} tok/s, "
                     f"pooled tau {pooled['acceptance_length_pooled']:.2f}) |")
    for key, report in load_results.items():
        if key == "soak":
            continue
        levels = {(r["concurrency"], r["speculation"]): r for r in report["levels"]}
        if (1, "on") in levels and (1, "off") in levels:
            ratio = levels[(1, "on")]["per_request_tok_s_mean"] / levels[(1, "off")]["per_request_tok_s_mean"]
            bench_speedup = bench_results[key.rsplit("-", 1)[1]]["pooled"]["speedup"]
            lines.append(f"| per-user speed at concurrency 1 close to the batch-1 speed-up ({key}) | {ratio:.2f}x "
                         f"(batch-1 bench: {bench_speedup:.2f}x) |")
        below = [f"{c} ({levels[(c, 'on')]['throughput_tok_s'] / levels[(c, 'off')]['throughput_tok_s']:.2f}x)"
                 for c, mode in sorted(levels) if mode == "on" and (c, "off") in levels
                 and levels[(c, "on")]["throughput_tok_s"] < levels[(c, "off")]["throughput_tok_s"]]
        lines.append(f"| aggregate throughput never below plain decoding ({key}) | "
                     f"{'met' if not below else 'below at concurrency ' + ', '.join(below)} |")
    greedy = bench_results["greedy"]
    steps = drafts = draft_s = verify_s = 0.0
    for result in greedy["benchmarks"].values():
        spec = result["speculative"]
        steps += spec["verify_steps"]
        drafts += spec["num_drafts"]
        draft_s += spec["time_split_s"].get("draft", 0.0)
        verify_s += spec["time_split_s"].get("verify", 0.0)
    if steps and drafts:
        pooled = greedy["pooled"]
        plain_ms = 1000 / pooled["baseline_tokens_per_s"]
        lines += ["", f"Why, from the greedy bench above: {drafts / steps:.0%} of the decode rounds drafted (the draft "
                  "gate holds blocks back for requests whose recent blocks did not pay, and the confidence "
                  "scheduler trims the rest); a drafted round spent "
                  f"{1000 * draft_s / drafts:.1f} ms in the draft network, and a round of any kind "
                  f"{1000 * verify_s / steps:.1f} ms verifying, against {plain_ms:.1f} ms per token for plain "
                  "decoding. So a drafted block must bring roughly "
                  f"{1000 * draft_s / drafts / plain_ms:.2f} accepted tokens just to pay for the draft pass; the "
                  f"pooled acceptance length over drafted rounds is {pooled['acceptance_length_pooled']:.2f} "
                  "(position 1: "
                  f"{pooled['acceptance_rate_per_pos'][0]:.2f}). The head's acceptance is the limit (training "
                  "compute on this machine: see the model card). Under load the load-aware switch turns drafting "
                  "off when it loses, which is what brings the aggregate back to plain decoding. On GPUs, where a "
                  "1T target step costs many times the draft's, the same code path is the one that pays."]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    global SOAK_SECONDS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=5, help="prompts per benchmark for dspark bench")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--peers-limit", type=int, default=6)
    parser.add_argument("--load-requests", type=int, default=8, help="requests per load level and mode")
    parser.add_argument("--load-max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--soak-seconds", type=float, default=120.0)
    parser.add_argument("--out-dir", default="docs/figures")
    parser.add_argument("--baseline-dtypes", default="float32,bfloat16",
                        help="plain-decoding dtypes of the bench's baseline; the faster counts")
    parser.add_argument("--skip", default="", help="comma-separated steps to reuse from out-dir: bench,peers,load")
    args = parser.parse_args(argv)
    SOAK_SECONDS = args.soak_seconds
    out = (REPO / args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    from benchmarks.peers import plot as peers_plot
    from benchmarks.peers import run as peers_run
    from benchmarks.peers import table as peers_table

    bench_results = ({k: json.loads((out / f"bench-{k}.json").read_text()) for k in ("greedy", "t1")}
                     if "bench" in skip else bench(out, args.limit, args.max_tokens, args.baseline_dtypes))
    if "peers" in skip:
        peers = json.loads((out / "peers.json").read_text())
    else:
        peers = peers_run(REPO / "configs" / "embedded.yaml", ["humaneval", "gsm8k"], args.peers_limit,
                          args.max_tokens, "auto", out / "peers-work")
        peers["markdown"] = peers_table(peers)
        (out / "peers.json").write_text(json.dumps(peers, indent=1))
        peers_plot(peers, out / "peers.png")
    if "load" in skip:
        load_results = {p.stem[5:]: json.loads(p.read_text()) for p in sorted(out.glob("load-*.json"))}
        if (out / "soak.json").exists():
            load_results["soak"] = json.loads((out / "soak.json").read_text())
    else:
        load_results = load(out, args.concurrency, args.load_requests, args.load_max_tokens)
    (REPO / "docs" / "performance.md").write_text(render(out, bench_results, peers, load_results, args))
    print(f"[report] wrote docs/performance.md and {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
