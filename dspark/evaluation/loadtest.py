"""``dspark loadtest``: replay benchmark prompts at fixed concurrency against a running server.

    dspark loadtest --url http://127.0.0.1:8000 [--grpc 127.0.0.1:9000] --dataset mt-bench \\
        --concurrency 1,4,16,32 --requests 32 --max-tokens 128 [--modes on,off] [--out load.json] [--plot load.png]

For each concurrency level and each mode (speculation on, and off through the request's
``speculation: false`` extension, on the same server in the same run), ``--requests`` requests
stream through ``--concurrency`` concurrent clients (HTTP server-sent events, or gRPC
``GenerateStream`` with ``--grpc``), bounded by ``--duration`` seconds per level. Reported per
level: aggregate output tokens/s, per-request tokens/s, time to first token and inter-token
latency (gaps between streamed chunks, and time per output token) at p50/p99, acceptance length
(pooled: tokens / verify steps), and errors by kind. Loopback addresses only, unless
``--allow-remote``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from dspark.evaluation.prompt_sets import read_prompts


@dataclass
class Record:
    """One request's outcome, as the client saw it."""

    ok: bool
    error: str = ""  # e.g. "http 503", "UNAVAILABLE", "timeout", "in-band unavailable"
    start: float = 0.0
    first_token: float = 0.0
    end: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    verify_steps: int = 0
    finish_reason: str = ""


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize(records: list[Record], wall_s: float) -> dict:
    done = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in done)
    steps = sum(r.verify_steps for r in done)
    per_request = [r.completion_tokens / (r.end - r.start) for r in done if r.end > r.start]
    ttft = [r.first_token - r.start for r in done if r.first_token]
    gaps = [g for r in done for g in r.chunk_gaps]
    tpot = [(r.end - r.first_token) / (r.completion_tokens - 1) for r in done
            if r.first_token and r.completion_tokens > 1]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(records), "completed": len(done), "errors": errors, "wall_s": wall_s,
        "output_tokens": tokens, "throughput_tok_s": tokens / wall_s if wall_s else 0.0,
        "per_request_tok_s_mean": sum(per_request) / len(per_request) if per_request else None,
        "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
        "itl_p50_s": _percentile(gaps, 0.5), "itl_p99_s": _percentile(gaps, 0.99),
        "tpot_p50_s": _percentile(tpot, 0.5), "tpot_p99_s": _percentile(tpot, 0.99),
        "acceptance_length": tokens / steps if steps else None,
    }


# ---------------------------------------------------------------------------- clients
class HttpSender:
    def __init__(self, url: str, api_key: str | None, model: str | None, timeout_s: float):
        import aiohttp

        self.url, self.model = url.rstrip("/"), model
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key
                                                                else {})}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def open(self) -> None:
        if self.model is None:
            async with self.session.get(self.url + "/v1/models", headers=self.headers) as response:
                response.raise_for_status()
                self.model = (await response.json())["data"][0]["id"]

    async def close(self) -> None:
        await self.session.close()

    async def send(self, prompt: str, params: dict, speculation: bool) -> Record:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                "speculation": speculation, **params}
        record = Record(ok=False, start=time.perf_counter())
        last = None
        async with self.session.post(self.url + "/v1/chat/completions", json=body, headers=self.headers) as response:
            if response.status != 200:
                record.error = f"http {response.status}"
                return record
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = f"in-band {chunk['error'].get('code') or chunk['error'].get('type')}"
                    return record
                now = time.perf_counter()
                content = any(c.get("delta", {}).get("content") for c in chunk.get("choices", []))
                if content:
                    if not record.first_token:
                        record.first_token = now
                    elif last is not None:
                        record.chunk_gaps.append(now - last)
                    last = now
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                if "spec" in chunk:  # the final chunk: usage and speculative-decoding statistics
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
                    record.verify_steps = chunk["spec"]["verify_steps"]
        record.end = time.perf_counter()
        record.ok = bool(record.finish_reason)
        record.error = "" if record.ok else "truncated stream"
        return record


class GrpcSender:
    def __init__(self, target: str, api_key: str | None, timeout_s: float):
        import grpc

        from dspark.v1 import serving_pb2_grpc

        self.channel = grpc.aio.insecure_channel(target)
        self.stub = serving_pb2_grpc.DSparkStub(self.channel)
        self.metadata = [("application", "dspark")] + ([("authorization", f"Bearer {api_key}")] if api_key else [])
        self.timeout_s = timeout_s

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        await self.channel.close()

    async def send(self, prompt: str, params: dict, speculation: bool) -> Record:
        import grpc

        from dspark.v1 import serving_pb2 as pb

        request = pb.GenerateRequest(prompt=prompt, chat=True, max_tokens=params["max_tokens"],
                                     temperature=params["temperature"], top_p=params["top_p"],
                                     speculation=speculation)
        record = Record(ok=False, start=time.perf_counter())
        last = None
        try:
            async for chunk in self.stub.GenerateStream(request, metadata=self.metadata, timeout=self.timeout_s):
                now = time.perf_counter()
                if chunk.token_ids:
                    if not record.first_token:
                        record.first_token = now
                    elif last is not None:
                        record.chunk_gaps.append(now - last)
                    last = now
                if chunk.finish_reason:
                    record.finish_reason = chunk.finish_reason
                    record.completion_tokens = chunk.usage.completion_tokens
                    record.verify_steps = chunk.spec.verify_steps
        except grpc.aio.AioRpcError as exc:
            record.error = exc.code().name
            return record
        record.end = time.perf_counter()
        record.ok = bool(record.finish_reason)
        record.error = "" if record.ok else "truncated stream"
        return record


# ---------------------------------------------------------------------------- the run
async def run_level(sender, prompts: list[str], concurrency: int, requests: int, params: dict, speculation: bool,
                    duration_s: float, progress=None) -> tuple[list[Record], float]:
    """``requests`` requests through ``concurrency`` workers; stops issuing after ``duration_s``."""
    queue: asyncio.Queue = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(prompts[index % len(prompts)])
    records: list[Record] = []
    start = time.perf_counter()

    async def worker() -> None:
        while not queue.empty() and time.perf_counter() - start < duration_s:
            prompt = queue.get_nowait()
            try:
                record = await sender.send(prompt, params, speculation)
            except TimeoutError:
                record = Record(ok=False, error="timeout")
            except OSError as exc:
                record = Record(ok=False, error=f"connection {type(exc).__name__}")
            records.append(record)
            if progress:
                progress(len(records), requests)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def check_loopback(address: str) -> None:
    host = urlparse(address if "://" in address else f"//{address}").hostname or ""
    for info in socket.getaddrinfo(host, None):
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            raise SystemExit(f"{address}: not a loopback address (pass --allow-remote to load-test it)")


async def run(args) -> dict:
    prompts = read_prompts(args.dataset)
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    api_key = args.api_key or os.environ.get("DSPARK_API_KEY")
    sender = (GrpcSender(args.grpc, api_key, args.timeout) if args.grpc
              else HttpSender(args.url, api_key, args.model, args.timeout))
    await sender.open()
    results = []
    try:
        for concurrency in levels:
            for mode in modes:
                def progress(done, total, c=concurrency, m=mode):
                    print(f"\r[loadtest] concurrency {c:>3} speculation {m:<3} {done}/{total}", end="",
                          file=sys.stderr, flush=True)

                records, wall = await run_level(sender, prompts, concurrency, args.requests, params, mode == "on",
                                                args.duration, progress)
                summary = {"concurrency": concurrency, "speculation": mode, **summarize(records, wall)}
                print(file=sys.stderr)
                results.append(summary)
    finally:
        await sender.close()
    return {"target": args.grpc or args.url, "transport": "grpc" if args.grpc else "http",
            "dataset": str(args.dataset), "params": params, "levels": results}


def table(report: dict) -> str:
    def fmt(value, scale=1.0, digits=1):
        return "-" if value is None else f"{value * scale:.{digits}f}"

    lines = ["| conc | spec | done/req | out tok/s | per-req tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | "
             "TPOT p50 ms | tau | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["levels"]:
        lines.append(f"| {r['concurrency']} | {r['speculation']} | {r['completed']}/{r['requests']} | "
                     f"{fmt(r['throughput_tok_s'])} | {fmt(r['per_request_tok_s_mean'])} | "
                     f"{fmt(r['ttft_p50_s'], 1e3, 0)}/{fmt(r['ttft_p99_s'], 1e3, 0)} | "
                     f"{fmt(r['itl_p50_s'], 1e3, 0)}/{fmt(r['itl_p99_s'], 1e3, 0)} | {fmt(r['tpot_p50_s'], 1e3, 0)} | "
                     f"{fmt(r['acceptance_length'], 1, 2)} | {r['errors'] or ''} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Aggregate throughput against per-request speed, one curve per mode (the paper's Figure 7 style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for mode, style in (("on", "o-"), ("off", "s--")):
        rows = [r for r in report["levels"] if r["speculation"] == mode and r["per_request_tok_s_mean"]]
        if not rows:
            continue
        ax.plot([r["per_request_tok_s_mean"] for r in rows], [r["throughput_tok_s"] for r in rows], style,
                label=f"speculation {mode}")
        for r in rows:
            ax.annotate(f"c={r['concurrency']}", (r["per_request_tok_s_mean"], r["throughput_tok_s"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("per-request output tokens/s")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title(f"{Path(report['dataset']).stem} via {report['transport']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> None:
    lt = sub.add_parser("loadtest", help="replay benchmark prompts at fixed concurrency against a server")
    lt.add_argument("--url", default="http://127.0.0.1:8000", help="HTTP base URL (OpenAI-compatible API)")
    lt.add_argument("--grpc", default=None, help="host:port: use gRPC GenerateStream instead of HTTP")
    lt.add_argument("--dataset", default="mt-bench", help="a named prompt set (benchmarks/data/) or a JSONL with "
                    "{\"turns\": [...]} per line")
    lt.add_argument("--concurrency", default="1,4,16,32", help="comma-separated concurrency levels")
    lt.add_argument("--requests", type=int, default=32, help="requests per level and mode")
    lt.add_argument("--duration", type=float, default=600.0, help="stop issuing requests after this many s per level")
    lt.add_argument("--max-tokens", type=int, default=128)
    lt.add_argument("--temperature", type=float, default=1.0)
    lt.add_argument("--top-p", type=float, default=0.95)
    lt.add_argument("--modes", default="on,off", help="speculation modes to run per level: on, off or both")
    lt.add_argument("--model", default=None, help="model name (default: the server's first)")
    lt.add_argument("--api-key", default=None, help="default: $DSPARK_API_KEY")
    lt.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    lt.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    lt.add_argument("--out", default=None, help="write the report as JSON")
    lt.add_argument("--plot", default=None, help="write throughput vs per-request speed as PNG")
    lt.set_defaults(func=main)


def main(args) -> int:
    if not args.allow_remote:
        check_loopback(args.grpc or args.url)
    if set(args.modes.split(",")) - {"on", "off"}:
        raise SystemExit(f"--modes: {args.modes!r}: use on, off or on,off")
    report = asyncio.run(run(args))
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, Path(args.plot))
    return 0 if all(r["completed"] == r["requests"] for r in report["levels"]) else 1

