"""Training a DSpark head on a target cache (paper 3.3, DeepSpec's recipe at CPU scale).

Each step samples sequences, and in each sequence random anchors among the response tokens.
Every anchor's block (anchor + gamma-1 masks) attends to the sequence's fused features
strictly before the anchor (one shared context per sequence, per-anchor visibility mask).
Position k predicts the token k after the anchor; the Markov head is teacher-forced with the
data's previous token. The target's embedding and LM head are shared and frozen.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from dspark.config import ConfigError
from dspark.jsonl import read_jsonl
from dspark.model.draft_model import DSparkDraft
from dspark.model.target_model import TargetModel
from dspark.training.calibration import cumulative_ece, sequential_temperature_scaling
from dspark.training.losses import dspark_loss
from dspark.training.target_cache import TargetCache


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    seqs_per_step: int = 4
    anchors_per_seq: int = 16
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    heldout_fraction: float = 0.05
    seed: int = 0
    time_budget_s: float | None = None
    eval_every: int = 0  # held-out tau into work_dir/curve.jsonl every this many steps (0: never), the learning curve
    eval_sequences: int = 64  # held-out sequences each curve point reads (the first of the held-out split)
    autocast_bf16: bool = False  # the draft's forward under bf16 autocast (the target's distributions stay fp32)
    compile: bool = False  # the draft's block pass through torch.compile (dynamic shapes) while training
    pack_sequences: int = 1  # sequences per block pass (block_forward): 1 on CPUs, many on GPUs


def init_from_target(draft: DSparkDraft, target: TargetModel) -> None:
    """Start the draft layers from the target's last layers (same shapes), a strong warm start."""
    n = len(draft.layers)
    for i, layer in enumerate(draft.layers):
        layer.load_state_dict(target.layers[target.config.num_layers - n + i].state_dict())
    draft.norm.load_state_dict(target.norm.state_dict())


def init_from_draft(draft: DSparkDraft, start: DSparkDraft, target: TargetModel,
                    vocabulary_ids: torch.Tensor | None = None) -> None:
    """Continue from an exported draft, possibly grown deeper, possibly onto a reduced vocabulary.

    Layers the export lacks are appended after its own: each starts as one of the target's last
    layers with its output projections (attention ``o_proj``, MLP ``down_proj``) zeroed, so it adds
    nothing to the residual stream and the grown draft computes exactly what the export did; training
    then opens the new layers up from there.

    A full-vocabulary export continues as a reduced-vocabulary draft when ``vocabulary_ids`` [V_draft]
    (the target ids the draft will emit) is given: its output-vocabulary rows (the Markov head's W2) are
    the export's rows of those ids, so over them the new draft scores tokens exactly as the export did.
    The reduced draft's LM head and mapping come from ``install_vocabulary`` after this.
    """
    own, wanted = len(start.layers), len(draft.layers)
    if own > wanted:
        raise ConfigError("draft.num_layers", f"{wanted} is fewer than the {own} layers of train.init_from")
    state = start.state_dict()
    installed: set[str] = set()  # what install_vocabulary gives a reduced draft that a full export lacks
    if draft.config.reduced_vocab and not start.config.reduced_vocab:
        if vocabulary_ids is None:
            raise ValueError("a full-vocabulary export continues onto a reduced vocabulary only given its ids")
        full = start.config.output_vocab_size
        for name, param in draft.state_dict().items():
            theirs = state.get(name)
            if theirs is not None and theirs.shape[0] == full and param.shape == (len(vocabulary_ids),
                                                                                 *theirs.shape[1:]):
                state[name] = theirs[vocabulary_ids]  # [V, ...] -> [V_draft, ...]: the kept tokens' rows
        installed = {"d2t", "t2d", "own.lm_head.weight"}
    elif draft.config.reduced_vocab != start.config.reduced_vocab:
        raise ConfigError("train.init_from", "a reduced-vocabulary export cannot continue as a full-vocabulary "
                                             "draft: set draft.draft_vocab_size to its size")
    try:
        missing, unexpected = draft.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes differ (hidden size, Markov rank, feature layers ...)
        raise ConfigError("train.init_from", f"does not match the draft: {err}") from None
    grown = {name for name in missing if name.startswith("layers.") and int(name.split(".")[1]) >= own}
    if unexpected or set(missing) - grown - installed:
        raise ConfigError("train.init_from", f"does not match the draft: missing "
                                             f"{sorted(set(missing) - grown - installed)}, "
                                             f"unexpected {sorted(unexpected)}")
    for i in range(own, wanted):
        layer = draft.layers[i]
        layer.load_state_dict(target.layers[target.config.num_layers - wanted + i].state_dict())
        with torch.no_grad():
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                for param in proj.parameters():
                    param.zero_()


def _anchors(cache: TargetCache, seq: int, anchors: int, block: int, rng: random.Random):
    """Random anchors of sequence ``seq`` among its response tokens (absolute indices [A]), the absolute index of the
    token each block position predicts [A, G] and whether it is inside the sequence [A, G]; None: too short."""
    start, end = cache.offsets[seq], cache.offsets[seq + 1]
    first = max(cache.response_starts[seq] - 1, start + 1)  # the anchor may be the last prompt token
    last = end - 2  # at least one label after the anchor
    if last < first:
        return None
    picks = sorted(rng.sample(range(first, last + 1), min(anchors, last - first + 1)))
    anchor = torch.tensor(picks)  # absolute indices
    label_index = anchor[:, None] + 1 + torch.arange(block)[None, :]  # [A, G]
    valid = label_index < end
    label_index = label_index.clamp(max=end - 1)
    return anchor, label_index, valid


def block_forward(draft: DSparkDraft, target: TargetModel, cache: TargetCache, seqs: list[int], anchors: int,
                  rng: random.Random, pick=None):
    """Draft logits, confidences, target distributions and labels for the anchors of the sequences ``seqs``, in
    one block pass: their contexts concatenated into one row [1, T, D] that every block attends to through its
    visibility mask (its own sequence, strictly before its anchor; positions count from each sequence's start).
    One sequence per pass is cheapest where compute is the limit (a CPU: a block attends to T keys of its own
    sequence only); a GPU, where launches are the limit, packs many (``TrainConfig.pack_sequences``).
    ``pick(seq, block)``, if given, chooses each sequence's anchors instead of ``_anchors`` (same return)."""
    block = draft.config.block_size
    if pick is None:
        def pick(seq, block):
            return _anchors(cache, seq, anchors, block, rng)
    picked = [(seq, p) for seq in seqs if (p := pick(seq, block)) is not None]
    if not picked:
        return None
    spans = [(cache.offsets[seq], cache.offsets[seq + 1]) for seq, _ in picked]
    anchor, label_index, valid = (torch.cat(x) for x in zip(*(p for _, p in picked)))  # [A], [A, G], [A, G]
    anchor_seq = torch.cat([torch.full((len(p[0]),), k) for k, (_, p) in enumerate(picked)])  # [A] its span
    starts = torch.tensor([a for a, _ in spans])[anchor_seq]  # [A] first row of each anchor's sequence
    features = cache.features[spans[0][0]:spans[0][1]] if len(spans) == 1 else \
        torch.cat([cache.features[a:b] for a, b in spans])
    context = draft.fuse(features.float())[None]  # [1, T, D]
    ctx_pos = torch.cat([torch.arange(b - a) for a, b in spans])  # [T] position inside its own sequence
    ctx_seq = torch.cat([torch.full((b - a,), k) for k, (a, b) in enumerate(spans)])  # [T]
    ctx_valid = (ctx_seq[None, :] == anchor_seq[:, None]) & (ctx_pos[None, :] < (anchor - starts)[:, None])
    block_ids, block_pos = draft.block_inputs(cache.tokens[anchor], anchor - starts, block)
    hidden = draft.predicting(draft.backbone(block_ids, block_pos, context, ctx_pos[None], None, None,
                                             context_valid=ctx_valid))
    base = draft.base_logits(hidden)
    prev = torch.cat((cache.tokens[anchor][:, None], cache.tokens[label_index[:, :-1]]), dim=1)
    logits, conf_logits, _ = draft.position_logits(base, hidden, prev, slice(None))
    labels = cache.tokens[label_index]
    with torch.no_grad(), torch.autocast(context.device.type, enabled=False):  # the target's distributions in fp32
        target_probs, outside, labels = target_distributions(draft, target, cache, label_index, labels)
    return logits, conf_logits, target_probs, labels, valid, outside


def packs(seqs: list[int], size: int) -> list[list[int]]:
    """``seqs`` in groups of ``size`` (the block passes of one step)."""
    return [seqs[i: i + size] for i in range(0, len(seqs), size)]


def target_distributions(draft: DSparkDraft, target: TargetModel, cache: TargetCache, label_index: torch.Tensor,
                         labels: torch.Tensor):
    """The target's next-token distributions at ``label_index`` [N, G] (from the hidden state one position before)
    in the draft's vocabulary, as :func:`in_draft_vocabulary` returns them. A reduced-vocabulary draft on a cache
    with the target's log-sum-exp runs the target's LM head over its own tokens only (exp(logit - logsumexp): the
    same probabilities as the full softmax, for the cost of V_draft rows instead of V)."""
    rows = label_index - 1
    weight = target.lm_head.weight
    hidden = cache.final_hidden[rows].to(weight.dtype)  # [N, G, H]
    if draft.config.reduced_vocab and cache.logsumexp is not None:
        ids = draft_target_ids(draft)
        bias = None if target.lm_head.bias is None else target.lm_head.bias[ids]
        logits = torch.nn.functional.linear(hidden, weight[ids], bias)  # [N, G, V_draft]
        inside = torch.exp(logits.float() - cache.logsumexp[rows][..., None])
        return inside, (1 - inside.sum(-1)).clamp_min(0), draft_labels(draft, labels)
    return in_draft_vocabulary(draft, torch.softmax(target.lm_head(hidden).float(), dim=-1), labels)


def draft_target_ids(draft: DSparkDraft) -> torch.Tensor:
    """[V_draft] the target id of each token a reduced-vocabulary draft can emit (speculators' d2t)."""
    return draft.to_target_ids(torch.arange(draft.config.output_vocab_size, device=draft.d2t.device))


def draft_labels(draft: DSparkDraft, labels: torch.Tensor) -> torch.Tensor:
    """Labels [N, G] (target ids) as the draft's ids; -1 for a token the draft cannot emit."""
    draft_index = torch.cumsum(draft.t2d.long(), 0) - 1  # [V] draft id of each target id the draft can emit
    return torch.where(draft.t2d[labels], draft_index[labels], torch.full_like(labels, -1))


def in_draft_vocabulary(draft: DSparkDraft, target_probs: torch.Tensor, labels: torch.Tensor):
    """The target's distributions [N, G, V] and labels [N, G] (target ids) in the draft's vocabulary: its tokens'
    probabilities [N, G, V_draft], the mass outside it [N, G] (0 with the full vocabulary) and the labels as draft
    ids (-1: a token the draft cannot emit)."""
    if not draft.config.reduced_vocab:
        return target_probs, target_probs.new_zeros(labels.shape), labels
    inside = target_probs[..., draft_target_ids(draft)]
    return inside, (1 - inside.sum(-1)).clamp_min(0), draft_labels(draft, labels)


@contextlib.contextmanager
def compiled_block_pass(draft: DSparkDraft, enabled: bool):
    """While inside, the draft's block pass (``backbone``: its layers over block and context) runs through
    ``torch.compile`` with dynamic shapes (context lengths differ per sequence). The compiled function is an instance
    attribute over the class's method, so parameters, state dict and export are untouched; leaving restores eager."""
    if not enabled:
        yield
        return
    draft.backbone = torch.compile(draft.backbone, dynamic=True)
    try:
        yield
    finally:
        del draft.backbone


def _save(draft: DSparkDraft, optimizer, step: int, path: Path, total: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"model": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "total": total},
               path / "train_state.pt.tmp")
    (path / "train_state.pt.tmp").rename(path / "train_state.pt")


def train(draft: DSparkDraft, target: TargetModel, cache: TargetCache, cfg: TrainConfig, work_dir: Path,
          log=print) -> dict:
    """Train (resuming from ``work_dir`` if a checkpoint is there); returns a summary."""
    from tqdm import tqdm

    if draft.config.reduced_vocab and not bool(draft.t2d.any()):
        raise ConfigError("draft_vocab_size", "a reduced-vocabulary draft needs its vocabulary chosen first "
                                              "(dspark.training.vocabulary; the recipe does it)")
    for p in target.parameters():
        p.requires_grad_(False)
    train_seqs, _ = cache.split(cfg.heldout_fraction, cfg.seed)
    if not train_seqs:
        raise ConfigError("data", f"the target cache holds {len(cache)} sequence(s), all of them held out: too few "
                                  "to train on (generate more responses)")
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, total = 0, cfg.steps  # total: the step count the learning-rate schedule decays over
    state_file = work_dir / "train_state.pt"
    if state_file.is_file():
        state = torch.load(state_file, weights_only=False)
        draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, total = state["step"], state.get("total", cfg.steps)
        log(f"[train] resumed at step {step}")
    def schedule(s: int) -> float:
        return min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(s / total, 1)))

    rng = random.Random(cfg.seed + step)
    device_type = next(draft.parameters()).device.type
    started, ema = time.time(), None
    curve = LearningCurve(work_dir / "curve.jsonl", cfg) if cfg.eval_every else None
    if curve is not None and step == 0 and not curve.points:
        curve.record(draft, target, cache, step, 0.0)
    bar = tqdm(total=cfg.steps, initial=step, desc="train", mininterval=5.0, dynamic_ncols=True)
    draft.train()
    first_step, clock_at_10 = step, None
    with compiled_block_pass(draft, cfg.compile):
        while step < total:
            if step == first_step + 10:
                clock_at_10 = time.time()
            if cfg.time_budget_s is not None and step == first_step + 20:
                # fit the schedule to the budget: decay over the steps the remaining time allows, at the rate of
                # steps 10-20 (the first ones compile, with train.compile, and warm the allocator)
                per_step = (time.time() - clock_at_10) / 10
                total = min(total, step + int((cfg.time_budget_s - (time.time() - started)) / per_step))
                bar.total = total
                log(f"[train] {per_step:.2f}s/step: schedule set to {total} steps for the time budget")
            if cfg.time_budget_s is not None and time.time() - started > cfg.time_budget_s:
                log(f"[train] time budget reached at step {step}")
                break
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * schedule(step)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
                parts = [block_forward(draft, target, cache, group, cfg.anchors_per_seq, rng)
                         for group in packs(rng.sample(train_seqs, min(cfg.seqs_per_step, len(train_seqs))),
                                            cfg.pack_sequences)]
            parts = [p for p in parts if p is not None]
            logits, conf, tprobs, labels, valid, outside = (torch.cat(x) for x in zip(*parts))
            terms = dspark_loss(logits.float(), conf.float(), tprobs, labels, valid, target_outside=outside)
            terms.total.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            step += 1
            metrics = {"loss": terms.total.item(), "acc1": terms.acceptance[0].item(),
                       "tau": terms.expected_length.item()}
            ema = metrics if ema is None else {k: 0.98 * ema[k] + 0.02 * v for k, v in metrics.items()}
            bar.set_postfix(loss=f"{ema['loss']:.3f}", acc1=f"{ema['acc1']:.3f}", tau=f"{ema['tau']:.2f}")
            bar.update(1)
            if curve is not None and (step % cfg.eval_every == 0 or step == total):
                curve.record(draft, target, cache, step, time.time() - started)
            if step % cfg.checkpoint_every == 0 or step == total:
                _save(draft, optimizer, step, work_dir, total)
                log(f"[train] step {step} loss {ema['loss']:.4f} acc1 {ema['acc1']:.3f} tau~{ema['tau']:.3f} "
                    f"({time.time() - started:.0f}s)")
    bar.close()
    _save(draft, optimizer, step, work_dir, total)
    draft.eval()
    return {"steps": step, "train_seconds": time.time() - started, **(ema or {})}


class LearningCurve:
    """Held-out acceptance against training progress, one JSON line per point (``curve.jsonl`` in the run's folder;
    a resumed run appends): step, anchors trained so far (the data positions each step starts a block at),
    training seconds of this process, and on the first ``cfg.eval_sequences`` held-out sequences the analytic
    expected acceptance length with full blocks (tau) and the per-position acceptances."""

    def __init__(self, path: Path, cfg: TrainConfig):
        self.path, self.cfg = path, cfg
        self.points = read_jsonl(path) if path.is_file() else []

    def record(self, draft: DSparkDraft, target: TargetModel, cache: TargetCache, step: int, seconds: float) -> dict:
        if self.points and self.points[-1]["step"] >= step:  # already measured (a resume at a checkpoint)
            return self.points[-1]
        held = heldout_summary(heldout_statistics(draft, target, cache, self.cfg,
                                                  max_sequences=self.cfg.eval_sequences))
        point = {"step": step, "anchors": step * self.cfg.seqs_per_step * self.cfg.anchors_per_seq,
                 "seconds": seconds, "block_size": len(held["heldout_acceptance_per_pos"]),
                 "heldout_tau": held["heldout_expected_length"],
                 "heldout_acceptance_per_pos": held["heldout_acceptance_per_pos"],
                 "heldout_blocks": held["heldout_blocks"]}
        self.points.append(point)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.write(json.dumps(point) + "\n")
        return point


@torch.no_grad()
def heldout_statistics(draft: DSparkDraft, target: TargetModel, cache: TargetCache, cfg: TrainConfig,
                       anchors: int = 32, max_sequences: int | None = None) -> dict[str, torch.Tensor]:
    """Raw confidence logits and analytic per-position acceptances on the held-out sequences (the first
    ``max_sequences`` of them if given)."""
    _, heldout = cache.split(cfg.heldout_fraction, cfg.seed)
    heldout = heldout[:max_sequences]
    rng = random.Random(1234)
    saved = draft.confidence_temperatures.clone()
    draft.confidence_temperatures.fill_(1.0)
    conf, accept, valid = [], [], []
    for group in packs(heldout, cfg.pack_sequences):
        part = block_forward(draft, target, cache, group, anchors, rng)
        if part is None:
            continue
        logits, conf_logits, tprobs, _, ok, outside = part
        l1 = (torch.softmax(logits, -1) - tprobs).abs().sum(-1) + outside
        conf.append(conf_logits)
        accept.append((1 - 0.5 * l1).clamp(0, 1))
        valid.append(ok)
    draft.confidence_temperatures.copy_(saved)
    return {"conf_logits": torch.cat(conf), "acceptance": torch.cat(accept), "valid": torch.cat(valid)}


def heldout_summary(stats: dict[str, torch.Tensor]) -> dict:
    """Per-position acceptance and the analytic expected acceptance length with full blocks (1 + the sum of the
    survival products) of :func:`heldout_statistics`' blocks."""
    accept = stats["acceptance"] * stats["valid"]  # [blocks, G]
    return {"heldout_acceptance_per_pos": accept.sum(0).div(stats["valid"].sum(0).clamp_min(1)).tolist(),
            "heldout_expected_length": float((1 + accept.cumprod(1).sum(1)).mean()),
            "heldout_blocks": int(accept.shape[0])}


def calibrate(draft: DSparkDraft, stats: dict[str, torch.Tensor]) -> dict:
    """Sequential Temperature Scaling on held-out statistics; sets the draft's temperatures."""
    conf, accept, valid = stats["conf_logits"], stats["acceptance"], stats["valid"]
    ones = torch.ones(conf.shape[1], dtype=torch.float64)
    before = cumulative_ece(conf.double(), accept, ones, valid)
    temps = sequential_temperature_scaling(conf, accept, valid)
    after = cumulative_ece(conf.double(), accept, torch.tensor(temps, dtype=torch.float64), valid)
    draft.confidence_temperatures.copy_(torch.tensor(temps))
    draft.config = replace(draft.config, confidence_temperatures=tuple(temps))
    return {"temperatures": list(temps), "ece_before": before, "ece_after": after, **heldout_summary(stats)}


def write_summary(path: Path, summary: dict, cfg: TrainConfig) -> None:
    path.write_text(json.dumps({"train_config": asdict(cfg), **summary}, indent=2) + "\n")
