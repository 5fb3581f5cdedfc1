"""Which thread steps vLLM's engine, and how its OpenMP threads wait: plain vLLM at batch 1, one run, side by side.

A Serve replica builds its engine in ``__init__`` and steps it from the serving loop's thread. libgomp gives every
thread that opens a parallel region its own pool of workers and counts them all; once they outnumber the CPUs it
spins only ~1,000 iterations before a worker sleeps, so each of a forward pass's hundreds of parallel regions
wakes its worker with a futex. ``actors.target_actor.vllm_target`` therefore builds on a thread that ends, and
the vllm backend's replica keeps libgomp's own spinning (``runtime.omp_wait_policy: auto``). Arrangements:

- ``built and stepped on one thread``: what offline vLLM does (the reference);
- ``stepped on a second thread``: built on the main thread, which lives on with its pool (the replica before);
- ``built on an ended thread``: ``vllm_target`` as the replica calls it, stepped on a second thread;

each with libgomp's default spinning and with ``GOMP_SPINCOUNT=20000`` (``omp_wait_policy: brief``), each
arrangement in its own process (libgomp reads its environment once).

    python -m benchmarks.engine_thread [--prompts 4] [--max-tokens 128] [--out engine_thread.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import REPO, machine

POLICIES = {"libgomp default spinning": {}, "GOMP_SPINCOUNT=20000 (brief)": {"GOMP_SPINCOUNT": "20000"}}
ARRANGEMENTS = ("built and stepped on one thread", "stepped on a second thread", "built on an ended thread")


def _decode(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Greedy, one request at a time: completion tokens per second of wall time."""
    from dspark.config import SamplingParams

    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           request_id=len(engine.requests))
        while engine.has_unfinished():
            tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def child(arrangement: str, prompts_count: int, max_tokens: int) -> float:
    from actors.target_actor import on_own_thread, vllm_target
    from dspark.evaluation.prompt_sets import read_prompts
    from dspark.integrations.vllm_0_32.engine import VllmEngine
    from dspark.loader import encode_chat
    from dspark.schema import load_engine_config, write_variant

    base = load_engine_config(REPO / "configs" / "embedded.yaml")
    path = write_variant(base, REPO / "out" / "engine_thread.json", engine={"vllm_speculation": "off"})
    config, _ = load_engine_config(path).with_concrete_dtypes()
    if arrangement == "built on an ended thread":
        engine = vllm_target(config)
    else:
        engine = VllmEngine(config)
    texts = [t for name in ("humaneval", "gsm8k") for t in read_prompts(name, prompts_count)]
    prompts = [encode_chat(engine.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    if arrangement == "built and stepped on one thread":
        _decode(engine, prompts[:1], 16)  # warm-up
        return _decode(engine, prompts, max_tokens)
    return on_own_thread(lambda: (_decode(engine, prompts[:1], 16), _decode(engine, prompts, max_tokens))[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts from each of humaneval and gsm8k")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="engine_thread.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"tok_s": child(args.child, args.prompts, args.max_tokens)}))
        return 0
    (REPO / "out").mkdir(exist_ok=True)
    rows = []
    for policy, extra in POLICIES.items():
        for arrangement in ARRANGEMENTS:
            env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
            env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(os.cpu_count()), **extra})
            print(f"[engine_thread] {policy}: {arrangement}", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, "-m", "benchmarks.engine_thread", "--child", arrangement,
                                   "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)],
                                  cwd=REPO, env=env, capture_output=True, text=True, check=True)
            tok_s = json.loads(done.stdout.strip().splitlines()[-1])["tok_s"]
            rows.append({"policy": policy, "arrangement": arrangement, "tok_s": tok_s})
    reference = rows[0]["tok_s"]
    lines = [f"{2 * args.prompts} prompts x up to {args.max_tokens} tokens, greedy, batch 1, vLLM plain, "
             f"{os.cpu_count()} OpenMP threads; {machine()}", "",
             "| OpenMP waiting | arrangement | tok/s | vs one thread, default spinning |", "|---|---|---:|---:|"]
    lines += [f"| {r['policy']} | {r['arrangement']} | {r['tok_s']:.1f} | {r['tok_s'] / reference:.2f}x |"
              for r in rows]
    report = {"machine": machine(), "rows": rows, "markdown": "\n".join(lines)}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
