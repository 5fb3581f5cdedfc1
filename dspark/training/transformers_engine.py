"""Responses for the data stage from ``transformers``' ``generate``: the engine where neither vLLM nor the native
engine is the fast choice (a GPU machine without vLLM: ``data.engine: transformers`` with ``device: cuda``).

It takes requests as the native engine and ``VllmEngine`` do (``add_request`` / ``step`` / ``has_unfinished``), so
``dspark.training.dataset.generate_responses`` drives it unchanged; each ``step`` generates one batch of queued
requests to the end. Requests of one batch share their sampling values (greedy and sampled requests go in separate
batches) and a batch's sampling is seeded by its first request's seed: responses are training data, not a
reproduction of per-request seeds. Sampling is temperature and top-p alone (``top_k: 0`` overrides transformers'
default of 50), as the other engines sample. Prompts are left-padded; a response ends at (and keeps) its first end
token.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.config import SamplingParams
from dspark.decoding.request import RequestOutput


class TransformersEngine:
    def __init__(self, target_dir: Path, dtype: str, device: str, batch: int, eos_ids: list[int]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        self.device, self.batch, self.eos_ids = device, batch, list(eos_ids)
        self.queue: list[tuple[int, list[int], SamplingParams]] = []
        self.requests: dict[int, list[int]] = {}  # request id -> prompt ids, until the caller pops it

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: int) -> None:
        self.queue.append((request_id, list(prompt_ids), params))
        self.requests[request_id] = list(prompt_ids)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def _take_batch(self) -> list[tuple[int, list[int], SamplingParams]]:
        """Up to ``batch`` queued requests with the first one's sampling values, in queue order."""
        kind = (self.queue[0][2].temperature, self.queue[0][2].top_p, self.queue[0][2].max_tokens)
        taken, kept = [], []
        for item in self.queue:
            same = (item[2].temperature, item[2].top_p, item[2].max_tokens) == kind
            (taken if same and len(taken) < self.batch else kept).append(item)
        self.queue = kept
        return taken

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if not self.queue:
            return []
        taken = self._take_batch()
        params = taken[0][2]
        width = max(len(ids) for _, ids, _ in taken)
        pad = self.eos_ids[0]
        ids = torch.tensor([[pad] * (width - len(p)) + p for _, p, _ in taken], device=self.device)  # [B, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _ in taken], device=self.device)
        sampling = ({"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
                    if params.temperature > 0 else {"do_sample": False})
        torch.manual_seed(params.seed if params.seed is not None else 0)
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=params.max_tokens,
                                  eos_token_id=self.eos_ids, pad_token_id=pad, **sampling)
        outputs = []
        for (request_id, _, _), row in zip(taken, out[:, width:].tolist()):
            end = next((k + 1 for k, t in enumerate(row) if t in self.eos_ids), len(row))
            stopped = bool(row) and row[end - 1] in self.eos_ids
            outputs.append(RequestOutput(request_id, row[:end], True, "stop" if stopped else "length"))
        return outputs

    def shutdown(self) -> None:
        self.queue.clear()
        del self.model
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
