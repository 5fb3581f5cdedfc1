"""Training throughput of the DSpark recipe, full vocabulary against reduced draft vocabularies, one run.

The same target (the embedded default's SmolLM2-135M-Instruct), the same target cache and the same batches go
through ``dspark.training.trainer.train`` (the recipe's own loop: forward, loss, backward, optimiser step) once per
draft vocabulary, a reduced one twice: the target's LM head and softmax over the whole vocabulary, then over the
draft's tokens only (with the log-sum-exp the cache keeps per position). The last one runs a third time with the
draft's forward under bf16 autocast (only on a CPU with native bf16: emulated, a step took 19x longer), and with
``--compile`` once more with the draft's block pass through ``torch.compile`` (``train.compile``). The figure is
block positions trained per second (anchors x block size per step) over the steps after the first ``--warm-steps``
(whose time, compilation included, is its own column).
The cache holds the target's states over text of the Python standard library (throughput does not depend on what the
text says; nothing trained here is kept).

    python -m benchmarks.train_step [--vocab 0,16384,8192] [--shapes 4x16,4x64] [--compile] [--steps 30]
        [--warm-steps 10] [--sequences 48] [--out train_step.json] [--plot train_step.png]

``--shapes`` adds rows for the last (reduced) vocabulary at larger batches: sequences x anchors per sequence per
step (``train.seqs_per_step`` x ``train.anchors_per_seq``; the recipe's default is 4x16). A step is mostly fixed
costs at 4x16 on a CPU, so more anchors per step train more positions per second.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.report import machine
from dspark.config import DecoderConfig, DraftConfig
from dspark.dtype_choice import choose_dtype
from dspark.formats.target_checkpoint import load_target
from dspark.loader import load_tokenizer
from dspark.model.draft_model import DSparkDraft
from dspark.training.prepare import prepare_target
from dspark.training.target_cache import build_target_cache, load_target_cache
from dspark.training.trainer import TrainConfig, init_from_target, train
from dspark.training.vocabulary import choose_vocabulary, end_of_turn_ids, install_vocabulary, response_token_counts

LAYERS = (2, 7, 21, 26, 28)  # the shipped head's (configs/train-smollm2.yaml)


def text_rows(tokenizer, sequences: int, prompt_tokens: int = 32, response_tokens: int = 224) -> list[dict]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rows = []
    for path in files:
        ids = tokenizer.encode(path.read_text(errors="ignore")[:8000])
        if len(ids) >= prompt_tokens + response_tokens:
            rows.append({"prompt_ids": ids[:prompt_tokens],
                         "response_ids": ids[prompt_tokens:prompt_tokens + response_tokens]})
        if len(rows) == sequences:
            break
    return rows


def make_draft(target, vocab_size: int, cache) -> tuple[DSparkDraft, dict | None]:
    tc = target.config
    backbone = DecoderConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_layers=2,
                             num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                             vocab_size=tc.vocab_size, rms_norm_eps=tc.rms_norm_eps, rope=tc.rope,
                             attention_bias=tc.attention_bias, qk_norm=tc.qk_norm,
                             max_position_embeddings=tc.max_position_embeddings, model_type=tc.model_type)
    torch.manual_seed(0)
    draft = DSparkDraft(DraftConfig(backbone=backbone, target_hidden_size=tc.hidden_size, target_layer_ids=LAYERS,
                                    block_size=7, mask_token_id=16, markov_rank=64, draft_vocab_size=vocab_size))
    init_from_target(draft, target)
    draft.bind_target(target.embed_tokens, target.lm_head)
    if not draft.config.reduced_vocab:
        return draft, None
    spans = [(cache.response_starts[i], cache.offsets[i + 1]) for i in range(len(cache))]
    vocabulary = choose_vocabulary(response_token_counts(cache.tokens, spans, tc.vocab_size), vocab_size,
                                   end_of_turn_ids(load_tokenizer(prepare_target())))
    install_vocabulary(draft, vocabulary, target.lm_head.weight)
    return draft, vocabulary.as_dict()


def run(vocab_sizes: list[int], steps: int, sequences: int, work: Path,
        shapes: tuple[tuple[int, int], ...] = (), compile_row: bool = False, warm_steps: int = 10) -> dict:
    target_dir = prepare_target()
    target, tokenizer = load_target(target_dir), load_tokenizer(target_dir)
    cache_dir = work / "cache"
    build_target_cache(target, text_rows(tokenizer, sequences), LAYERS, cache_dir)
    cache = load_target_cache(cache_dir)
    if not 0 < warm_steps < steps:
        raise SystemExit(f"--warm-steps {warm_steps}: must be between 1 and --steps {steps} - 1")
    # the checkpoint after the warm-up steps logs a line: the clock for the steady steps starts there
    cfg = TrainConfig(steps=steps, seqs_per_step=4, anchors_per_seq=16, warmup=5, checkpoint_every=warm_steps,
                      heldout_fraction=0.05)
    rows = []
    # a reduced vocabulary runs twice: the target's LM head over the whole vocabulary (its softmax), then over the
    # draft's tokens alone with the cache's log-sum-exp (the recipe's default where the cache has it)
    # and the last reduced one a third time with the draft's forward under bf16 autocast (train.autocast_bf16) where
    # the CPU has native bf16, and with --compile once more with its block pass compiled (train.compile)
    base_shape = (cfg.seqs_per_step, cfg.anchors_per_seq)
    variants = [(v, head, False, False, base_shape) for v in vocab_sizes
                for head in (("full",) if not v else ("full", "draft"))]
    if vocab_sizes[-1]:
        native_bf16 = choose_dtype()
        if native_bf16.dtype == "bfloat16":
            variants.append((vocab_sizes[-1], "draft", True, False, base_shape))
        else:  # emulated bf16 measured 19x slower a step than fp32 on a 2-core AVX2 EPYC: nothing to learn
            print(f"[train_step] no bf16 autocast row: {native_bf16.reason}", flush=True)
        if compile_row:
            variants.append((vocab_sizes[-1], "draft", False, True, base_shape))
        variants += [(vocab_sizes[-1], "draft", False, False, shape) for shape in shapes if shape != base_shape]
    for size, target_head, autocast, compiled, (seqs, anchors) in variants:
        draft, vocabulary = make_draft(target, size, cache)
        run_cfg = replace(cfg, autocast_bf16=autocast, compile=compiled, seqs_per_step=seqs, anchors_per_seq=anchors)
        clock = {}
        start = time.perf_counter()
        summary = train(draft, target, cache if target_head == "draft" else replace(cache, logsumexp=None), run_cfg,
                        work / f"train-{size}-{target_head}-{autocast}-{compiled}-{seqs}x{anchors}",
                        log=lambda line, clock=clock: clock.setdefault("warm", time.perf_counter()))
        end = time.perf_counter()
        steady = summary["steps"] - warm_steps
        positions = steady * seqs * anchors * draft.config.block_size
        rows.append({"draft_vocab": size or target.config.vocab_size, "reduced": bool(vocabulary),
                     "target_head": target.config.vocab_size if target_head == "full" else size,
                     "seqs_per_step": seqs, "anchors_per_seq": anchors,
                     "autocast_bf16": autocast, "compiled": compiled, "final_loss": summary.get("loss"),
                     "coverage": vocabulary["coverage"] if vocabulary else 1.0, "steps": summary["steps"],
                     "warm_steps": warm_steps, "warm_seconds": clock["warm"] - start,
                     "seconds_per_step": (end - clock["warm"]) / steady,
                     "positions_per_s": positions / (end - clock["warm"]),
                     "trainable_parameters": sum(p.numel() for p in draft.parameters() if p.requires_grad)})
        print(f"[train_step] vocabulary {rows[-1]['draft_vocab']}, target head over {rows[-1]['target_head']}"
              f"{', bf16 autocast' if autocast else ''}{', compiled' if compiled else ''}, {seqs}x{anchors}: "
              f"first {warm_steps} steps {rows[-1]['warm_seconds']:.1f} s, then {rows[-1]['seconds_per_step']:.3f} "
              f"s/step", flush=True)
    base = rows[0]["positions_per_s"]
    for r in rows:
        r["vs_first"] = r["positions_per_s"] / base
    return {"machine": machine(), "steps": steps, "sequences": len(cache), "rows": rows}


def draft_forward(row: dict) -> str:
    return ("bf16 autocast" if row["autocast_bf16"] else "fp32") + (", compiled" if row.get("compiled") else "")


def table(report: dict) -> str:
    warm = report["rows"][0]["warm_steps"]
    lines = [f"{report['steps']} steps each, the first {warm} timed apart (compilation, allocator warm-up); "
             f"7 positions per anchor; {report['machine']}", "",
             "| draft vocabulary | target LM head over | draft forward | sequences x anchors per step | response "
             f"coverage | first {warm} steps (s) | s/step after | positions trained/s | vs first | trainable params |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['draft_vocab']} | {r['target_head']} | {draft_forward(r)} "
                     f"| {r['seqs_per_step']}x{r['anchors_per_seq']} | {r['coverage']:.4f} | {r['warm_seconds']:.1f} "
                     f"| {r['seconds_per_step']:.3f} | "
                     f"{r['positions_per_s']:.0f} | {r['vs_first']:.2f}x | {r['trainable_parameters'] / 1e6:.1f}M |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([f"{r['draft_vocab']} / {r['target_head']} / {draft_forward(r)} / "
             f"{r['seqs_per_step']}x{r['anchors_per_seq']}" for r in rows],
            [r["positions_per_s"] for r in rows])
    ax.set_xlabel("block positions trained per second")

    ax.set_title("DSpark training throughput\n(draft vocabulary / target head over / draft forward / batch)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="0,16384,8192", help="draft vocabularies (0: the target's whole one)")
    parser.add_argument("--shapes", default="", help="comma-separated SEQSxANCHORS batches for the last vocabulary")
    parser.add_argument("--compile", action="store_true",
                        help="one more row: the last vocabulary with the draft's block pass through torch.compile")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-steps", type=int, default=10, help="first steps of each row, timed apart")
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--out", default="train_step.json")
    parser.add_argument("--plot", default="train_step.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        shapes = tuple(tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",") if shape)
        report = run([int(v) for v in args.vocab.split(",")], args.steps, args.sequences, Path(tmp), shapes,
                     args.compile, args.warm_steps)
    report["markdown"] = table(report)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    plot(report, Path(args.plot))
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
