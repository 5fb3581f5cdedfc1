"""The target cache for training: fused-layer features and final hidden states of every token.

Storing the hidden state before the LM head (not logits) keeps the cache O(hidden) per token;
the trainer applies the frozen LM head only at the positions it samples (DSpark paper, 5.1).
"""

from __future__ import annotations

import bisect
import json
import mmap
import random
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.model.target_model import TargetModel


class ShardRows:
    """The rows of several shards' [n_i, D] tensors as one [sum n_i, D] tensor, for lookups that stay inside one
    shard (the trainer reads one sequence at a time, and a shard holds whole sequences): ``rows[a:b]`` and
    ``rows[index]`` (a LongTensor of absolute rows) return the shard's rows, without copying the shards into one."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts
        self.starts = [0]
        for part in parts:
            self.starts.append(self.starts[-1] + len(part))

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), *self.parts[0].shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def _shard(self, first: int, last: int) -> tuple[torch.Tensor, int]:
        i = bisect.bisect_right(self.starts, first) - 1
        if not 0 <= first <= last < self.starts[i + 1]:
            raise IndexError(f"rows {first}..{last} are not inside one shard of the target cache")
        return self.parts[i], self.starts[i]

    def __getitem__(self, index):
        if isinstance(index, slice):
            if index.stop <= index.start:
                return self.parts[0][:0]
            part, base = self._shard(index.start, index.stop - 1)
            return part[index.start - base: index.stop - base]
        if len(self.parts) == 1:
            return self.parts[0][index]
        first, last = int(index.min()), int(index.max())
        i = bisect.bisect_right(self.starts, first) - 1
        if last < self.starts[i + 1]:  # one shard (one sequence's rows)
            return self.parts[i][index - self.starts[i]]
        # rows of several shards (sequences packed into one block pass): each shard's rows from that shard
        bounds = torch.tensor(self.starts[1:-1], device=index.device)
        shard_of = torch.bucketize(index, bounds, right=True)
        out = self.parts[0].new_empty((*index.shape, *self.parts[0].shape[1:]))
        for k in shard_of.unique().tolist():
            rows = shard_of == k
            out[rows] = self.parts[k][index[rows] - self.starts[k]]
        return out

    def to(self, device: torch.device | str) -> ShardRows:
        """All rows as one tensor on ``device`` (a GPU holds a multi-GB cache; lookups may then span sequences),
        copied part by part (no second whole copy in host memory)."""
        whole = torch.empty(self.shape, dtype=self.dtype, device=device)
        for part, start in zip(self.parts, self.starts):
            whole[start: start + len(part)].copy_(part)
        return ShardRows([whole])


def mapped_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as read-only views of the memory-mapped file (no copy: the page cache
    holds what fits, so a cache larger than RAM still trains)."""
    with path.open("rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_bytes))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    base = 8 + header_bytes
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable": the views are read only
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype, (begin, end) = _SAFETENSORS_DTYPES[meta["dtype"]], meta["data_offsets"]
            count = (end - begin) // dtype.itemsize
            flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin) if count else \
                torch.empty(0, dtype=dtype)
            out[name] = flat.view(meta["shape"])
    return out


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
                       "I32": torch.int32}


@dataclass
class TargetCache:
    tokens: torch.Tensor  # [N] int64, all sequences concatenated
    features: ShardRows  # [N, K * hidden] bfloat16: hidden states after the feature layers (memory-mapped shards)
    final_hidden: ShardRows  # [N, hidden] bfloat16: normed input of the LM head (memory-mapped shards)
    offsets: list[int]  # sequence i spans offsets[i] .. offsets[i + 1]
    response_starts: list[int]  # first response token of sequence i (absolute index)
    layer_ids: tuple[int, ...]
    # [N] float32: log-sum-exp of the target's logits from final_hidden as stored (None: a cache built before it was
    # kept), so a reduced-vocabulary trainer computes the target's probabilities of its tokens alone
    logsumexp: ShardRows | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def to(self, device: torch.device | str) -> TargetCache:
        """The cache on ``device``, each stored tensor as one contiguous tensor there."""
        return replace(self, tokens=self.tokens.to(device), features=self.features.to(device),
                       final_hidden=self.final_hidden.to(device),
                       logsumexp=None if self.logsumexp is None else self.logsumexp.to(device))

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
    shard: dict[str, list] = {"tokens": [], "features": [], "final": [], "logsumexp": [], "lengths": [],
                              "prompt_lengths": []}
    shard_index, tokens_in_shard = len(list(out_dir.glob("shard_*.safetensors"))), 0
    done_rows = _rows_done(out_dir)
    cache = target.make_cache(4096, 16)

    def flush() -> None:
        nonlocal shard, shard_index, tokens_in_shard
        if not shard["lengths"]:
            return
        tensors = {"tokens": torch.cat(shard["tokens"]), "features": torch.cat(shard["features"]),
                   "final_hidden": torch.cat(shard["final"]), "logsumexp": torch.cat(shard["logsumexp"]),
                   "lengths": torch.tensor(shard["lengths"]), "prompt_lengths": torch.tensor(shard["prompt_lengths"])}
        save_file({k: v.cpu() for k, v in tensors.items()}, str(out_dir / f"shard_{shard_index:04d}.safetensors"))
        shard_index += 1
        shard = {k: [] for k in shard}
        tokens_in_shard = 0

    for i, row in enumerate(rows):
        if i < done_rows or not row["response_ids"]:
            continue
        ids = torch.tensor(row["prompt_ids"] + row["response_ids"])[:4000]
        cache.allocator.reserve(0, len(ids))
        meta = cache.allocator.metadata([0], [0], [len(ids)], device=ids.device)
        out = target(ids[None], torch.arange(len(ids))[None], cache, meta, logits_at=torch.zeros(1, 1,
                     dtype=torch.long), feature_layers=wanted)
        cache.allocator.free(0)
        per_layer = out.features[0].split(target.config.hidden_size, dim=-1)
        feats = torch.cat([per_layer[wanted.index(i)] for i in layer_ids], dim=-1)
        shard["tokens"].append(ids)
        shard["features"].append(feats.to(torch.bfloat16))
        final = target.norm(per_layer[wanted.index(last)]).to(torch.bfloat16)
        shard["final"].append(final)
        shard["logsumexp"].append(target_logsumexp(target, final))
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


def target_logsumexp(target: TargetModel, final_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """[n] float32 log-sum-exp of the target's logits from ``final_hidden`` [n, hidden] as the cache stores it
    (bf16), through the LM head as the trainer applies it (in the LM head's dtype), chunk by chunk."""
    out = [torch.logsumexp(target.lm_head(final_hidden[i: i + chunk].to(target.lm_head.weight.dtype)).float(), -1)
           for i in range(0, len(final_hidden), chunk)]
    return torch.cat(out) if out else torch.zeros(0)


def _rows_done(out_dir: Path) -> int:
    meta = out_dir / "progress.json"
    return json.loads(meta.read_text())["rows_done"] if meta.is_file() else 0


def _write_progress(out_dir: Path, rows_done: int, layer_ids: tuple[int, ...]) -> None:
    (out_dir / "progress.json").write_text(json.dumps({"rows_done": rows_done, "layer_ids": list(layer_ids)}))


def load_target_cache(out_dir: Path) -> TargetCache:
    shards = sorted(out_dir.glob("shard_*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no target cache shards in {out_dir}")
    parts = [mapped_safetensors(s) for s in shards]
    lengths = torch.cat([p["lengths"] for p in parts]).tolist()
    prompt_lengths = torch.cat([p["prompt_lengths"] for p in parts]).tolist()
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    meta = json.loads((out_dir / "progress.json").read_text())
    return TargetCache(
        tokens=torch.cat([p["tokens"] for p in parts]).long(),
        features=ShardRows([p["features"] for p in parts]),
        final_hidden=ShardRows([p["final_hidden"] for p in parts]),
        logsumexp=ShardRows([p["logsumexp"] for p in parts]) if all("logsumexp" in p for p in parts) else None,
        offsets=offsets,
        response_starts=[o + p for o, p in zip(offsets, prompt_lengths)],
        layer_ids=tuple(meta["layer_ids"]),
    )
