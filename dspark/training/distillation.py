"""Distillation over existing text, in resumable stretches whose state lives in git.

Each step the target reads ``seqs_per_step`` corpus rows once (:func:`teacher_pass`, the served default's dtype),
and every head trained beside it (the DSpark head, a gamma = 1 next-token control, and for the first
``ablation_tokens`` the no-Markov ablation) learns from that one pass: anchors drawn in the rows' replies, each
head's block pass and loss (``dspark.training.trainer.block_forward``, ``dspark_loss``), its own optimiser.

Determinism: which rows a step reads depends only on how many rows of each shard were read before it (the
``consumed`` counts in the state: each step takes the shard furthest behind its share, so sources mix in
proportion to their size and shards added later join the mix), and the anchors only on ``(seed, step)``. A run
interrupted and resumed therefore reads the same rows with the same anchors in the same order as one that never
stopped.

State, two copies:
- local (``work_dir``, outside git), every ``checkpoint_s``: fp32 weights and optimiser states, for a resume on the
  same machine;
- committed (``state_dir``, in git), every ``export_s`` with a learning-curve point: each head's weights in bf16
  (the frozen LM head rows left out: the target's rows of the vocabulary), ``state.json`` (step, tokens read,
  consumed counts, seed, schedule) and ``curve.jsonl``. A resume from it restarts the optimiser with a short
  warm-up (``warmup`` steps, visible on the curve).
SIGTERM (or Ctrl-C) ends a run cleanly: the step in progress finishes, then a curve point, the export and the local
checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dspark.config import DraftConfig
from dspark.model.draft_model import DSparkDraft
from dspark.model.target_model import TargetModel
from dspark.training.corpus import read_shard
from dspark.training.losses import dspark_loss
from dspark.training.teacher import teacher_pass
from dspark.training.trainer import block_forward, init_from_target
from dspark.training.vocabulary import DraftVocabulary, install_vocabulary


@dataclass(frozen=True)
class DistillConfig:
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # the cosine decays to lr * this
    schedule_tokens: int = 20_000_000  # ... over this many tokens read (then stays there)
    warmup: int = 100  # steps of linear warm-up after every optimiser (re)start
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    ablation_tokens: int = 2_000_000  # the no-Markov ablation trains beside the head until this many tokens
    vocab_rows: int = 96  # rows the target reads to choose the reduced vocabulary by its probability mass
    heldout_per_source: int = 4  # held-out rows of each source each curve point reads
    eval_anchors: int = 48
    checkpoint_s: float = 300.0
    export_s: float = 1800.0  # a curve point and the committed state, this often
    time_budget_s: float | None = None
    max_steps: int | None = None


# ------------------------------------------------------------------------------------------------------- corpus

class CorpusRows:
    """Every training row of the corpus under ``root`` (one folder per source, ``dspark.training.corpus``), in
    the deterministic order the ``consumed`` counts define, and the held-out rows."""

    def __init__(self, root: Path):
        self.root = root
        self.manifests = {m.parent.name: json.loads(m.read_text()) for m in sorted(root.glob("*/manifest.json"))}
        if not self.manifests:
            raise FileNotFoundError(f"no corpus under {root} (dspark corpus build)")
        self.shards = {f"{name}/{s['file']}": s["sequences"] for name, m in self.manifests.items()
                       for s in m["shards"]}
        self._loaded: dict[str, tuple[np.ndarray, list[np.ndarray]]] = {}

    @property
    def tokens(self) -> int:
        return sum(m["tokens"] for m in self.manifests.values())

    def _load(self, key: str) -> tuple[np.ndarray, list[np.ndarray]]:
        if key not in self._loaded:
            ids, spans = read_shard(self.root / key)
            by_row = [spans[spans[:, 0] == r, 1:] for r in range(len(ids))]
            self._loaded[key] = (ids, by_row)
        return self._loaded[key]

    def next_keys(self, consumed: dict[str, int], count: int) -> list[tuple[str, int]]:
        """The next ``count`` (shard, row) pairs after ``consumed``, which they advance. When every shard is read
        through, the counts restart (a new epoch)."""
        out = []
        for _ in range(count):
            left = [k for k, n in self.shards.items() if consumed.get(k, 0) < n]
            if not left:
                consumed.clear()
                left = sorted(self.shards)
            key = min(left, key=lambda k: ((consumed.get(k, 0) + 0.5) / self.shards[k], k))
            out.append((key, consumed.get(key, 0)))
            consumed[key] = consumed.get(key, 0) + 1
        return out

    def rows(self, keys: list[tuple[str, int]]) -> tuple[torch.Tensor, list[np.ndarray]]:
        """Token ids [B, L] and each row's reply spans [m, 2] (first reply token, end-of-turn token)."""
        loaded = [self._load(k) for k, _ in keys]
        ids = np.stack([data[0][r] for data, (_, r) in zip(loaded, keys)])
        return torch.from_numpy(ids.astype(np.int64)), [data[1][r] for data, (_, r) in zip(loaded, keys)]

    def heldout(self, per_source: int) -> tuple[torch.Tensor, list[np.ndarray], list[str]]:
        ids, spans, names = [], [], []
        for name, manifest in self.manifests.items():
            rows, row_spans = read_shard(self.root / name / manifest["heldout"]["file"])
            for r in range(min(per_source, len(rows))):
                ids.append(rows[r])
                spans.append(row_spans[row_spans[:, 0] == r, 1:])
                names.append(name)
        return torch.from_numpy(np.stack(ids).astype(np.int64)), spans, names


def anchor_picker(spans: list[np.ndarray], length: int, anchors: int, rng: random.Random):
    """``pick(seq, block)`` for :func:`block_forward` over a teacher batch: ``anchors`` anchors of row ``seq`` drawn
    from its reply spans (the anchor may be the last header token; it predicts up to the end-of-turn token), each
    block position valid up to its own span's end. Draws happen in row order, so they depend on ``rng`` alone."""
    draws = []
    for row_spans in spans:
        candidates = [p for start, end in row_spans.tolist() for p in range(start - 1, end)]
        picks = sorted(rng.sample(candidates, min(anchors, len(candidates)))) if candidates else []
        ends = {p: end for start, end in row_spans.tolist() for p in range(start - 1, end)}
        draws.append((picks, [ends[p] for p in picks]))

    def pick(seq: int, block: int):
        picks, ends = draws[seq]
        if not picks:
            return None
        base = seq * length
        anchor = torch.tensor(picks) + base  # [A] absolute rows of the teacher batch
        label_index = anchor[:, None] + 1 + torch.arange(block)[None, :]  # [A, G]
        valid = label_index <= (torch.tensor(ends) + base)[:, None]
        return anchor, label_index.clamp(max=base + length - 1), valid

    pick.draws = [picks for picks, _ in draws]  # each row's anchor positions, for a trace
    return pick


# -------------------------------------------------------------------------------------------------------- heads

@dataclass
class Head:
    name: str
    draft: DSparkDraft
    optimizer: torch.optim.Optimizer
    ema: dict | None = None


def head_configs(dspark: DraftConfig, ablation: bool) -> dict[str, DraftConfig]:
    from dataclasses import replace

    heads = {"dspark": dspark, "control": replace(dspark, block_size=1, confidence_temperatures=())}
    if ablation:
        heads["no-markov"] = replace(dspark, enable_markov_head=False)
    return heads


def make_head(name: str, cfg: DraftConfig, target32: TargetModel, vocabulary: DraftVocabulary,
              train: DistillConfig) -> Head:
    torch.manual_seed(train.seed)
    draft = DSparkDraft(cfg)
    init_from_target(draft, target32)
    draft.bind_target(target32.embed_tokens, target32.lm_head)
    install_vocabulary(draft, vocabulary, target32.lm_head.weight)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, betas=(0.9, 0.95))
    return Head(name, draft, opt)


def _committed_tensors(draft: DSparkDraft) -> dict[str, torch.Tensor]:
    """What the committed state keeps of a head: everything but its LM head (the target's rows of its vocabulary,
    rebuilt from d2t), in bf16; d2t / t2d as they are."""
    out = {}
    for name, tensor in draft.state_dict().items():
        if name == "own.lm_head.weight":
            continue
        out[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return {k: v.contiguous() for k, v in out.items()}


@torch.no_grad()
def choose_vocabulary_by_mass(target: TargetModel, corpus: CorpusRows, layer_ids: tuple[int, ...], size: int,
                              always: tuple[int, ...], rows: int, log=print) -> DraftVocabulary:
    """The ``size`` target ids with the most probability mass in the target's next-token distributions over the
    replies of the first ``rows`` rows of the reading order (plus ``always``); coverage: the mass they hold."""
    keys = corpus.next_keys({}, rows)
    mass = torch.zeros(target.config.vocab_size, dtype=torch.float64)
    for first in range(0, rows, 4):
        ids, spans = corpus.rows(keys[first: first + 4])
        cache = teacher_pass(target, ids, layer_ids)
        length = ids.shape[1]
        index = torch.tensor([r * length + p for r, s in enumerate(spans) for a, b in s.tolist()
                              for p in range(a - 1, b)])
        for chunk in index.split(2048):
            hidden = cache.final_hidden[chunk].to(target.lm_head.weight.dtype)
            mass += torch.softmax(torch.nn.functional.linear(hidden, target.lm_head.weight).float(), -1).sum(0).double()
        log(f"[vocab] {min(first + 4, rows)}/{rows} rows read")
    score = mass.clone()
    score[list(always)] = float("inf")
    ids = torch.sort(torch.sort(-score, stable=True).indices[:size]).values
    return DraftVocabulary(ids, target.config.vocab_size, float(mass[ids].sum() / mass.sum()))


# ------------------------------------------------------------------------------------------------------ trainer

class Distiller:
    def __init__(self, target: TargetModel, target32: TargetModel, corpus: CorpusRows, dspark_cfg: DraftConfig,
                 cfg: DistillConfig, work_dir: Path, state_dir: Path, eot_ids: tuple[int, ...], log=print):
        self.target, self.target32, self.corpus, self.cfg = target, target32, corpus, cfg
        self.work_dir, self.state_dir, self.log = work_dir, state_dir, log
        self.layer_ids = tuple(dspark_cfg.target_layer_ids)
        self.dspark_cfg, self.eot_ids = dspark_cfg, eot_ids
        for p in list(target.parameters()) + list(target32.parameters()):
            p.requires_grad_(False)
        self.state = {"step": 0, "tokens_read": 0, "consumed": {}, "optimizer_since": 0, "seed": cfg.seed,
                      "train_seconds": 0.0, "config": asdict(cfg)}
        self.heads: dict[str, Head] = {}
        self.trace: list | None = None  # set to a list: each step's (step, rows, anchors) is appended
        self._resume()

    # ---- state
    def _vocabulary_from(self, d2t: torch.Tensor) -> DraftVocabulary:
        ids = torch.arange(len(d2t)) + d2t
        return DraftVocabulary(ids, self.target.config.vocab_size, float(self.state.get("vocab_mass", 0.0)))

    def _resume(self) -> None:
        local = self.work_dir / "state.pt"
        committed = self.state_dir / "state.json"
        committed_step = json.loads(committed.read_text())["step"] if committed.is_file() else -1
        if local.is_file() and torch.load(local, weights_only=False)["state"]["step"] >= committed_step:
            saved = torch.load(local, weights_only=False)
            self.state.update(saved["state"])
            vocabulary = self._vocabulary_from(saved["heads"]["dspark"]["model"]["d2t"])
            for name, cfg in head_configs(self.dspark_cfg, "no-markov" in saved["heads"]).items():
                head = make_head(name, cfg, self.target32, vocabulary, self.cfg)
                head.draft.load_state_dict(saved["heads"][name]["model"])
                head.optimizer.load_state_dict(saved["heads"][name]["optimizer"])
                head.ema = saved["heads"][name].get("ema")
                self.heads[name] = head
            self.log(f"[distill] resumed from {local} at step {self.state['step']} "
                     f"({self.state['tokens_read']} tokens read)")
            return
        if committed.is_file():
            self.state.update(json.loads(committed.read_text()))
            tensors = {name: load_file(str(self.state_dir / f"{name}.safetensors"))
                       for name in self.state["heads"]}
            vocabulary = self._vocabulary_from(tensors["dspark"]["d2t"])
            for name, cfg in head_configs(self.dspark_cfg, "no-markov" in tensors).items():
                head = make_head(name, cfg, self.target32, vocabulary, self.cfg)
                missing, unexpected = head.draft.load_state_dict(
                    {k: v.float() if v.is_floating_point() else v for k, v in tensors[name].items()}, strict=False)
                if unexpected or set(missing) - {"own.lm_head.weight"}:
                    raise ValueError(f"{name}: committed state does not match the head ({missing}, {unexpected})")
                install_vocabulary(head.draft, vocabulary, self.target32.lm_head.weight)
                self.heads[name] = head
            self.state["optimizer_since"] = self.state["step"]  # fresh optimisers: warm up again
            self.log(f"[distill] resumed from the committed state {committed} at step {self.state['step']} "
                     f"({self.state['tokens_read']} tokens read; optimisers restart with {self.cfg.warmup} "
                     "warm-up steps)")
            return
        vocabulary = choose_vocabulary_by_mass(self.target, self.corpus, self.layer_ids,
                                               self.dspark_cfg.output_vocab_size, self.eot_ids, self.cfg.vocab_rows,
                                               self.log)
        self.state["vocab_mass"] = vocabulary.coverage
        self.log(f"[distill] vocabulary: {len(vocabulary.ids)} tokens holding {vocabulary.coverage:.4f} of the "
                 f"target's probability mass over {self.cfg.vocab_rows} rows")
        for name, cfg in head_configs(self.dspark_cfg, self.cfg.ablation_tokens > 0).items():
            self.heads[name] = make_head(name, cfg, self.target32, vocabulary, self.cfg)

    def save_local(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        blob = {"state": self.state, "heads": {n: {"model": h.draft.state_dict(), "optimizer": h.optimizer.state_dict(),
                                                   "ema": h.ema} for n, h in self.heads.items()}}
        torch.save(blob, self.work_dir / "state.pt.tmp")
        os.replace(self.work_dir / "state.pt.tmp", self.work_dir / "state.pt")

    def export(self) -> None:
        """The committed state: heads in bf16, state.json (the curve is appended by :meth:`evaluate`)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for name, head in self.heads.items():
            save_file(_committed_tensors(head.draft), str(self.state_dir / f"{name}.safetensors.tmp"))
            os.replace(self.state_dir / f"{name}.safetensors.tmp", self.state_dir / f"{name}.safetensors")
        for stale in set(p.name.split(".")[0] for p in self.state_dir.glob("*.safetensors")) - set(self.heads):
            (self.state_dir / f"{stale}.safetensors").unlink()
        state = {**self.state, "heads": sorted(self.heads)}
        (self.state_dir / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")

    # ---- one step
    def lr(self) -> float:
        cfg, state = self.cfg, self.state
        progress = min(state["tokens_read"] / cfg.schedule_tokens, 1.0)
        decay = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        warm = min(1.0, (state["step"] - state["optimizer_since"] + 1) / cfg.warmup)
        return cfg.lr * decay * warm

    def batch(self, step: int, consumed: dict[str, int]):
        """The rows and anchors of ``step`` (advancing ``consumed``): (keys, ids [B, L], pick)."""
        keys = self.corpus.next_keys(consumed, self.cfg.seqs_per_step)
        ids, spans = self.corpus.rows(keys)
        pick = anchor_picker(spans, ids.shape[1], self.cfg.anchors_per_seq,
                             random.Random(f"{self.cfg.seed}/{step}"))
        return keys, ids, pick

    def step(self) -> dict:
        keys, ids, pick = self.batch(self.state["step"], self.state["consumed"])
        if self.trace is not None:
            self.trace.append((self.state["step"], keys, pick.draws))
        cache = teacher_pass(self.target, ids, self.layer_ids)
        lr, metrics = self.lr(), {}
        for name, head in self.heads.items():
            for group in head.optimizer.param_groups:
                group["lr"] = lr
            head.optimizer.zero_grad(set_to_none=True)
            parts = [block_forward(head.draft, self.target, cache, [row], 0, None, pick=pick)
                     for row in range(len(keys))]
            parts = [p for p in parts if p is not None]
            logits, conf, target_probs, labels, valid, outside = (torch.cat(x) for x in zip(*parts))
            terms = dspark_loss(logits.float(), conf.float(), target_probs, labels, valid, target_outside=outside)
            terms.total.backward()
            torch.nn.utils.clip_grad_norm_([p for p in head.draft.parameters() if p.requires_grad],
                                           self.cfg.grad_clip)
            head.optimizer.step()
            values = {"loss": float(terms.total.detach()), "acc1": float(terms.acceptance[0]),
                      "tau": float(terms.expected_length)}
            head.ema = values if head.ema is None else {k: 0.98 * head.ema[k] + 0.02 * v for k, v in values.items()}
            metrics[name] = values
        self.state["step"] += 1
        self.state["tokens_read"] += int(ids.numel())
        return metrics

    def end_ablation(self) -> None:
        """Past ``ablation_tokens`` the no-Markov ablation stops: a last curve point for every head (the ablation
        against the DSpark head at the same point), then it is dropped."""
        if "no-markov" in self.heads and self.state["tokens_read"] >= self.cfg.ablation_tokens:
            self.evaluate()
            self.log(f"[distill] the no-Markov ablation stops at {self.state['tokens_read']} tokens")
            del self.heads["no-markov"]

    # ---- learning curve
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out expected acceptance length (analytic, teacher forced, full blocks) and per-position
        acceptance of every head on the held-out rows, one JSON line in ``state_dir/curve.jsonl``."""
        ids, spans, _ = self.corpus.heldout(self.cfg.heldout_per_source)
        accept: dict[str, list] = {n: [] for n in self.heads}
        valid: dict[str, list] = {n: [] for n in self.heads}
        outside_mass = []
        for first in range(0, len(ids), 4):
            cache = teacher_pass(self.target, ids[first: first + 4], self.layer_ids)
            pick = anchor_picker(spans[first: first + 4], ids.shape[1], self.cfg.eval_anchors,
                                 random.Random(f"heldout/{first}"))
            for name, head in self.heads.items():
                head.draft.eval()
                for row in range(min(4, len(ids) - first)):
                    part = block_forward(head.draft, self.target, cache, [row], 0, None, pick=pick)
                    if part is None:
                        continue
                    logits, _, target_probs, _, ok, outside = part
                    l1 = (torch.softmax(logits.float(), -1) - target_probs).abs().sum(-1) + outside
                    accept[name].append((1 - 0.5 * l1).clamp(0, 1) * ok)
                    valid[name].append(ok)
                    if name == "dspark":
                        outside_mass.append(outside[ok].float())
                head.draft.train()
        point = {"step": self.state["step"], "tokens_read": self.state["tokens_read"],
                 "train_seconds": round(self.state["train_seconds"], 1), "lr": self.lr(),
                 "vocab_outside_mass": float(torch.cat(outside_mass).mean()), "heads": {}}
        for name in self.heads:
            a, v = torch.cat(accept[name]), torch.cat(valid[name])
            point["heads"][name] = {"tau": float((1 + a.cumprod(1).sum(1)).mean()),
                                    "acceptance_per_pos": (a.sum(0) / v.sum(0).clamp_min(1)).tolist()}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with (self.state_dir / "curve.jsonl").open("a") as out:
            out.write(json.dumps(point) + "\n")
        self.log("[curve] " + json.dumps(point))
        return point

    # ---- the loop
    def run(self, pause_file: Path | None = None) -> dict:
        cfg = self.cfg
        started = time.time()
        last_checkpoint = last_export = time.time()
        curve = self.state_dir / "curve.jsonl"
        if not curve.is_file() or not curve.read_text().strip():
            self.evaluate()
            self.export()
        clock, tokens_at_clock = time.time(), self.state["tokens_read"]
        stop = []  # SIGTERM / SIGINT: finish the step, then the last curve point, export and checkpoint
        previous = {sig: signal.signal(sig, lambda *_: stop.append(True)) for sig in (signal.SIGTERM, signal.SIGINT)} \
            if threading.current_thread() is threading.main_thread() else {}
        while not stop:
            if cfg.max_steps is not None and self.state["step"] >= cfg.max_steps:
                break
            if cfg.time_budget_s is not None and time.time() - started >= cfg.time_budget_s:
                break
            if pause_file is not None and pause_file.exists():
                self.log("[distill] paused (pause file present)")
                while pause_file.exists():
                    time.sleep(2)
                self.log("[distill] resumed")
                clock, tokens_at_clock = time.time(), self.state["tokens_read"]
            t0 = time.time()
            self.step()
            self.state["train_seconds"] += time.time() - t0
            self.end_ablation()

            if self.state["step"] % 10 == 0:
                rate = (self.state["tokens_read"] - tokens_at_clock) / (time.time() - clock)
                tokens_at_clock = self.state["tokens_read"]
                clock = time.time()
                heads = " ".join(f"{n}: loss {h.ema['loss']:.3f} acc1 {h.ema['acc1']:.3f} tau {h.ema['tau']:.2f}"
                                 for n, h in self.heads.items())
                self.log(f"[distill] step {self.state['step']} tokens {self.state['tokens_read']} "
                         f"({rate:.0f} tok/s) lr {self.lr():.2e} | {heads}")
            if time.time() - last_checkpoint >= cfg.checkpoint_s:
                self.save_local()
                last_checkpoint = time.time()
            if time.time() - last_export >= cfg.export_s:
                self.evaluate()
                self.export()
                self.save_local()
                last_export = time.time()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        self.log(f"[distill] stopping at step {self.state['step']}: last curve point, export, checkpoint")
        self.evaluate()
        self.export()
        self.save_local()
        return dict(self.state)


def load_committed_head(state_dir: Path, name: str, target32: TargetModel, cfg: DraftConfig) -> DSparkDraft:
    """A committed head as a draft bound to ``target32`` (its LM head rebuilt from the target's rows)."""
    tensors = load_file(str(state_dir / f"{name}.safetensors"))
    draft = DSparkDraft(cfg)
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False)
    ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    install_vocabulary(draft, DraftVocabulary(ids, target32.config.vocab_size, 0.0), target32.lm_head.weight)
    return draft.bind_target(target32.embed_tokens, target32.lm_head)
