"""A soak run against a running server: mixed requests with cancellations, then leak checks.

    python -m benchmarks.soak --url http://127.0.0.1:8000 --duration 600 [--workers 4] [--out soak.json]

Workers loop for ``--duration`` seconds over a mix of streaming, non-streaming and abandoned
(closed after the first chunk) chat requests, each tagged with its own ``user`` id. At the end it
checks, and reports: every request got exactly one answer (a final chunk, a response or a clear
error; an abandoned stream counts as answered by the client), no response id was seen twice, the
replica's KV cache is entirely free again, and the resident memory of every DSpark process (Serve
replica, target shards, drafter) grew by less than ``--rss-bound-mib`` after warm-up. Progress goes to
stderr every 10 s. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import requests

DSPARK_ACTORS = ("ServeReplica:", "TargetShard", "DraftWorker")


def dspark_process_rss() -> dict[int, int]:
    """RSS in bytes of this machine's DSpark processes (pid -> bytes), found by their Ray process titles."""
    import psutil

    rss = {}
    for proc in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        title = " ".join(proc.info["cmdline"] or [])
        if title.startswith("ray::") and any(name in title for name in DSPARK_ACTORS):
            rss[proc.info["pid"]] = proc.info["memory_info"].rss
    return rss


class Soak:
    def __init__(self, url: str, api_key: str | None, model: str, max_tokens: int, prompts: list[str]):
        self.url, self.model, self.max_tokens, self.prompts = url.rstrip("/"), model, max_tokens, prompts
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.lock = threading.Lock()
        self.sent: dict[str, str] = {}  # request tag -> outcome ("" until answered)
        self.answers: dict[str, int] = {}  # request tag -> answers seen
        self.response_ids: list[str] = []
        self.outcomes: dict[str, int] = {}

    def _record(self, tag: str, outcome: str, response_id: str | None = None) -> None:
        with self.lock:
            self.answers[tag] = self.answers.get(tag, 0) + 1
            self.sent[tag] = outcome
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if response_id:
                self.response_ids.append(response_id)

    def one(self, rng: random.Random, tag: str) -> None:
        kind = rng.choice(["stream", "unary", "abandon"])
        body = {"model": self.model, "messages": [{"role": "user", "content": rng.choice(self.prompts)}],
                "max_tokens": rng.randint(4, self.max_tokens), "temperature": rng.choice([0.0, 1.0]),
                "user": tag, "stream": kind != "unary"}
        with self.lock:
            self.sent[tag] = ""
        response = requests.post(self.url + "/v1/chat/completions", json=body, headers=self.headers,
                                 stream=kind != "unary", timeout=300)
        with response:
            if response.status_code != 200:
                return self._record(tag, f"http {response.status_code}")
            if kind == "unary":
                out = response.json()
                return self._record(tag, "finished", out["id"])
            finals, ident = 0, None
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return self._record(tag, f"in-band {chunk['error'].get('code')}")
                ident = chunk["id"]
                if kind == "abandon":
                    return self._record(tag, "abandoned")  # closing the response cancels it server-side
                finals += any(c.get("finish_reason") for c in chunk["choices"])
            self._record(tag, "finished" if finals == 1 else f"{finals} final chunks", ident)

    def worker(self, index: int, deadline: float) -> None:
        rng = random.Random(index)
        count = 0
        while time.monotonic() < deadline:
            tag = f"w{index}-{count}"
            count += 1
            try:
                self.one(rng, tag)
            except requests.RequestException as exc:
                self._record(tag, f"client {type(exc).__name__}")


def wait_idle(url: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = requests.get(url.rstrip("/") + "/health", timeout=30).json()
        if health["in_flight"] == 0 and health["kv_free_blocks"] == health["kv_total_blocks"]:
            return health
        if time.monotonic() > deadline:
            return health
        time.sleep(0.5)


def run(url: str, duration_s: float, workers: int = 4, api_key: str | None = None, max_tokens: int = 48,
        rss_bound_mib: float = 256.0, warmup_s: float = 10.0, prompts: list[str] | None = None) -> dict:
    model = requests.get(url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"}
                         if api_key else {}, timeout=30).json()["data"][0]["id"]
    soak = Soak(url, api_key, model, max_tokens, prompts or ["Tell me about the sea.", "Count to twenty.",
                                                             "Write a Python function that reverses a list.",
                                                             "What is 17 times 23?"])
    start = time.monotonic()
    threads = [threading.Thread(target=soak.worker, args=(i, start + duration_s), daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    time.sleep(min(warmup_s, duration_s / 2))
    rss_start = dspark_process_rss()
    while any(t.is_alive() for t in threads):
        for thread in threads:
            thread.join(timeout=10)
        print(f"[soak] {time.monotonic() - start:5.0f} s  {len(soak.answers)} requests  {soak.outcomes}",
              file=sys.stderr, flush=True)
    health = wait_idle(url)
    rss_end = dspark_process_rss()
    growth = {pid: (rss_end[pid] - rss_start[pid]) / 2**20 for pid in rss_start if pid in rss_end}
    unanswered = [tag for tag, outcome in soak.sent.items() if not outcome]
    duplicates = [tag for tag, n in soak.answers.items() if n != 1]
    report = {
        "duration_s": duration_s, "workers": workers, "requests": len(soak.sent), "outcomes": soak.outcomes,
        "unanswered": unanswered, "answered_more_than_once": duplicates,
        "duplicate_response_ids": len(soak.response_ids) - len(set(soak.response_ids)),
        "kv_free_after": health["kv_free_blocks"], "kv_total": health["kv_total_blocks"],
        "in_flight_after": health["in_flight"], "rss_growth_mib": growth, "rss_bound_mib": rss_bound_mib,
    }
    report["ok"] = (not unanswered and not duplicates and report["duplicate_response_ids"] == 0
                    and health["kv_free_blocks"] == health["kv_total_blocks"] and health["in_flight"] == 0
                    and all(g < rss_bound_mib for g in growth.values()))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rss-bound-mib", type=float, default=256.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = run(args.url, args.duration, args.workers, args.api_key, args.max_tokens, args.rss_bound_mib)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
