"""The target cache for training: fused-layer features and final hidden states of every token.

Storing the hidden state before the LM head (not logits) keeps the cache O(hidden) per token;
the trainer applies the frozen LM head only at the positions it samples (DSpark paper, 5.1).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.model.target_model import TargetModel


@dataclass
class TargetCache:
    tokens: torch.Tensor  # [N] int64, all sequences concatenated
    features: torch.Tensor  # [N, K * hidden] bfloat16: hidden states after the feature layers
    final_hidden: torch.Tensor  # [N, hidden] bfloat16: normed input of the LM head
    offsets: list[int]  # sequence i spans offsets[i] .. offsets[i + 1]
    response_starts: list[int]  # first response token of sequence i (absolute index)
    layer_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def split(self, heldout_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
        """(train, held-out) sequence indices. Each sequence's side comes from its own draw of a seeded
        stream, so appending sequences (more data) leaves every earlier sequence where it was."""
        rng = random.Random(seed)
        draws = [rng.random() for _ in range(len(self))]
        heldout = {i for i, u in enumerate(draws) if u < heldout_fraction}
        if not heldout and draws:  # tiny caches still hold one sequence out
            heldout = {min(range(len(draws)), key=draws.__getitem__)}
        return [i for i in range(len(self)) if i not in heldout], sorted(heldout)


@torch.inference_mode()
def build_target_cache(target: TargetModel, rows: list[dict], layer_ids: tuple[int, ...], out_dir: Path,
                       shard_tokens: int = 65536, log_every: int = 50) -> None:
    """Run the target once over every (prompt + response) and write shards of features."""
    out_dir.mkdir(parents=True, exist_ok=True)
    last = target.config.num_layers - 1
    wanted = tuple(sorted(set(layer_ids) | {last}))
    shard: dict[str, list] = {"tokens": [], "features": [], "final": [], "lengths": [], "prompt_lengths": []}
    shard_index, tokens_in_shard = len(list(out_dir.glob("shard_*.safetensors"))), 0
    done_rows = _rows_done(out_dir)
    cache = target.make_cache(4096, 16)

    def flush() -> None:
        nonlocal shard, shard_index, tokens_in_shard
        if not shard["lengths"]:
            return
        save_file({"tokens": torch.cat(shard["tokens"]), "features": torch.cat(shard["features"]),
                   "final_hidden": torch.cat(shard["final"]), "lengths": torch.tensor(shard["lengths"]),
                   "prompt_lengths": torch.tensor(shard["prompt_lengths"])},
                  str(out_dir / f"shard_{shard_index:04d}.safetensors"))
        shard_index += 1
        shard = {k: [] for k in shard}
        tokens_in_shard = 0

    for i, row in enumerate(rows):
        if i < done_rows or not row["response_ids"]:
            continue
        ids = torch.tensor(row["prompt_ids"] + row["response_ids"])[:4000]
        cache.allocator.reserve(0, len(ids))
        meta = cache.allocator.metadata([0], [0], [len(ids)])
        out = target(ids[None], torch.arange(len(ids))[None], cache, meta, logits_at=torch.zeros(1, 1,
                     dtype=torch.long), feature_layers=wanted)
        cache.allocator.free(0)
        per_layer = out.features[0].split(target.config.hidden_size, dim=-1)
        feats = torch.cat([per_layer[wanted.index(i)] for i in layer_ids], dim=-1)
        shard["tokens"].append(ids)
        shard["features"].append(feats.to(torch.bfloat16))
        shard["final"].append(target.norm(per_layer[wanted.index(last)]).to(torch.bfloat16))
        shard["lengths"].append(len(ids))
        shard["prompt_lengths"].append(min(len(row["prompt_ids"]), len(ids)))
        tokens_in_shard += len(ids)
        if tokens_in_shard >= shard_tokens:
            flush()
            _write_progress(out_dir, i + 1, layer_ids)
        if (i + 1) % log_every == 0:
            print(f"[cache] {i + 1}/{len(rows)} sequences", flush=True)
    flush()
    _write_progress(out_dir, len(rows), layer_ids)


def _rows_done(out_dir: Path) -> int:
    meta = out_dir / "progress.json"
    return json.loads(meta.read_text())["rows_done"] if meta.is_file() else 0


def _write_progress(out_dir: Path, rows_done: int, layer_ids: tuple[int, ...]) -> None:
    (out_dir / "progress.json").write_text(json.dumps({"rows_done": rows_done, "layer_ids": list(layer_ids)}))


def load_target_cache(out_dir: Path) -> TargetCache:
    shards = sorted(out_dir.glob("shard_*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no target cache shards in {out_dir}")
    parts = [load_file(str(s)) for s in shards]
    lengths = torch.cat([p["lengths"] for p in parts]).tolist()
    prompt_lengths = torch.cat([p["prompt_lengths"] for p in parts]).tolist()
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    meta = json.loads((out_dir / "progress.json").read_text())
    return TargetCache(
        tokens=torch.cat([p["tokens"] for p in parts]).long(),
        features=torch.cat([p["features"] for p in parts]),
        final_hidden=torch.cat([p["final_hidden"] for p in parts]),
        offsets=offsets,
        response_starts=[o + p for o, p in zip(offsets, prompt_lengths)],
        layer_ids=tuple(meta["layer_ids"]),
    )
