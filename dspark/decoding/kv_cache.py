"""Paged KV cache: a fixed token budget split into blocks, handed to sequences on demand.

Admission reserves a sequence's worst-case number of blocks up front (prompt + max new
tokens + one draft block), so a running sequence never runs out; blocks are materialised
lazily as the sequence grows, given back on rollback (rejected draft tokens) and freed when
the sequence ends. Block 0 is a scratch block that padding tokens write into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFullError(RuntimeError):
    """The cache cannot reserve the blocks a sequence needs."""


@dataclass
class AttentionMetadata:
    """Where a batch's new tokens are written and which cached tokens each one reads."""

    write_slots: torch.Tensor  # [B, Q] int64 flat slot index of each new token (pads -> scratch)
    read_slots: torch.Tensor  # [B, L] int64 flat slot index of each key to read (pads -> scratch)
    mask: torch.Tensor  # [B, Q, L] bool: query may attend key
    query_valid: torch.Tensor  # [B, Q] bool: real (non-pad) query token
    key_valid: torch.Tensor  # [B, L] bool: key belongs to the sequence (not padding)


class BlockAllocator:
    """Token budget bookkeeping: block tables, reservations, lengths."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is scratch)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, 0, -1))  # block 0 is scratch
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._reserved: dict[int, int] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks neither in use nor promised to a running sequence."""
        promised = sum(self._reserved[s] - len(self.tables[s]) for s in self.tables)
        return len(self._free) - promised

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def can_reserve(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens)
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds a reservation")
        if need > self.num_free_blocks:
            raise CacheFullError(f"need {need} KV blocks, {self.num_free_blocks} free")
        self.tables[seq_id], self.lengths[seq_id], self._reserved[seq_id] = [], 0, need

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Make room for ``num_tokens`` stored tokens of ``seq_id`` (within its reservation)."""
        table, need = self.tables[seq_id], self.blocks_for(num_tokens)
        if need > self._reserved[seq_id]:
            raise CacheFullError(f"sequence {seq_id} exceeds its reservation of {self._reserved[seq_id]} blocks")
        while len(table) < need:
            table.append(self._free.pop())
        self.lengths[seq_id] = max(self.lengths[seq_id], num_tokens)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of ``seq_id``; give back whole blocks past them."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())
        self.lengths[seq_id] = num_tokens

    def free(self, seq_id: int) -> None:
        if seq_id not in self.tables:
            return
        self._free.extend(reversed(self.tables.pop(seq_id)))
        del self.lengths[seq_id], self._reserved[seq_id]

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        table, bs = self.tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def metadata(
        self,
        seq_ids: list[int],
        starts: list[int],  # first new position per sequence
        num_new: list[int],  # new tokens per sequence (0 allowed: read only)
        causal: bool = True,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Grow every sequence to hold its new tokens and describe the batch's reads and writes."""
        q_max = max(max(num_new), 1)
        totals = [s + n for s, n in zip(starts, num_new)]
        l_max = max(max(totals), 1)
        write = torch.zeros(len(seq_ids), q_max, dtype=torch.long)
        read = torch.zeros(len(seq_ids), l_max, dtype=torch.long)
        for b, (sid, start, n, total) in enumerate(zip(seq_ids, starts, num_new, totals)):
            self.grow(sid, total)
            slots = self.slots(sid, 0, total)
            read[b, :total] = torch.tensor(slots, dtype=torch.long)
            write[b, :n] = read[b, start:total]
        starts_t = torch.tensor(starts)[:, None]
        new_t = torch.tensor(num_new)[:, None]
        q_idx = torch.arange(q_max)[None, :]
        query_valid = q_idx < new_t
        key_idx = torch.arange(l_max)[None, None, :]
        totals_t = torch.tensor(totals)[:, None, None]
        key_valid = key_idx[:, 0, :] < totals_t[:, :, 0]
        mask = key_idx < totals_t
        if causal:
            mask = mask & (key_idx <= (starts_t + q_idx)[:, :, None])
        # Pad queries see one key so softmax stays finite; their outputs are ignored.
        mask = mask | (~query_valid[:, :, None] & (key_idx == 0))
        return AttentionMetadata(
            write.to(device), read.to(device), mask.to(device), query_valid.to(device), key_valid.to(device)
        )


class PagedKVCache:
    """Per-layer key/value storage indexed by flat slot; the allocator says which slots are whose."""

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        block_size: int,
        num_heads: int,
        key_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        num_blocks = max(num_tokens // block_size, 1) + 1  # + scratch block
        self.allocator = BlockAllocator(num_blocks, block_size)
        slots = num_blocks * block_size
        self.keys = [torch.zeros(slots, num_heads, key_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [
            torch.zeros(slots, num_heads, value_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [B, T]; k: [B, T, H, Dk]; v: [B, T, H, Dv]
        self.keys[layer].index_copy_(0, slots.flatten(), k.flatten(0, 1).to(self.keys[layer].dtype))
        self.values[layer].index_copy_(0, slots.flatten(), v.flatten(0, 1).to(self.values[layer].dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # slots: [B, L] -> k: [B, L, H, Dk], v: [B, L, H, Dv]
        shape = slots.shape
        k = self.keys[layer].index_select(0, slots.flatten()).unflatten(0, shape)
        v = self.values[layer].index_select(0, slots.flatten()).unflatten(0, shape)
        return k, v

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
