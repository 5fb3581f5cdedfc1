"""vLLM's top-k/top-p on a CPU: its full sort of every row against the plugin's sort-free cut, one run.

The rows are the embedded target's own bf16 logits where it samples (T=1 / top-p 0.95 continuations of
shared-set prompts, rows shuffled), cut at top-p 0.95, in batches of the rows a step truncates: 1 (plain decoding,
batch 1), 8 (one request verifying 7 drafts), 64 (8 requests verifying 7 drafts each). Median of ``--repeats`` calls
per cell; both functions get a fresh copy.

    python -m benchmarks.top_k_top_p [--repeats 30] [--out top_k_top_p.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.report import REPO, machine
from dspark.evaluation.prompt_sets import read_prompts
from dspark.loader import encode_chat, load_tokenizer
from dspark.schema import load_engine_config
from dspark.training.prepare import prepare_target

BATCHES = (1, 8, 64)


def target_logits(per_set: int = 2, tokens: int = 64) -> torch.Tensor:  # [rows, V] float32
    """The target's logits at the positions it samples: T=1 / top-p 0.95 continuations of shared-set prompts."""
    import transformers

    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    prepare_target()
    path = config.resolve(config.target.path)
    tok = load_tokenizer(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    torch.manual_seed(0)
    rows = []
    for name in ("mt-bench", "gsm8k", "humaneval"):
        for text in read_prompts(name, per_set):
            ids = torch.tensor([encode_chat(tok, [{"role": "user", "content": text}])])
            out = model.generate(ids, max_new_tokens=tokens, do_sample=True, temperature=1.0, top_p=0.95,
                                 output_logits=True, return_dict_in_generate=True)
            rows.append(torch.cat(out.logits).float())
    return torch.cat(rows)[torch.randperm(sum(len(r) for r in rows))]


def median_ms(fn, logits: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        x = logits.clone()
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2] * 1e3


def main() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from dspark.integrations.vllm_0_32.sampler import apply_top_k_top_p

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("top_k_top_p.json"))
    args = parser.parse_args()
    logits = target_logits()
    print(f"machine: {machine()}")
    print("| rows | vLLM's sort (ms) | sort-free (ms) | speed-up |\n|---:|---:|---:|---:|")
    rows = []
    for batch in BATCHES:
        x = logits[:batch]
        p = torch.full((batch,), 0.95)
        ms_vllm = median_ms(lambda y, p=p: apply_top_k_top_p_pytorch(y, None, p, allow_cpu_sync=True), x,
                            args.repeats)
        ms_ours = median_ms(lambda y, p=p: apply_top_k_top_p(y, None, p), x, args.repeats)
        rows.append({"rows": batch, "vllm_ms": ms_vllm, "sort_free_ms": ms_ours})
        print(f"| {batch} | {ms_vllm:.2f} | {ms_ours:.2f} | {ms_vllm / ms_ours:.1f}x |")
    args.out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
