"""A reduced draft vocabulary: the target tokens a draft can emit, chosen from the training responses.

The draft's LM head, Markov output projection and loss then run over ``size`` tokens instead of the target's whole
vocabulary (49,152 for SmolLM2): the block positions' LM head, forward and backward, is most of a training step.
The mapping is speculators' and vLLM's (``d2t``: target id = draft id + ``d2t[draft id]``; ``t2d``: which target
ids the draft can emit), so the checkpoint reads as theirs. Verification stays exact: the draft's distributions
are zero outside its vocabulary, which only lowers acceptance where the target puts mass there (``coverage`` says
how much of the training responses the chosen tokens cover).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocabulary:
    ids: torch.Tensor  # [V_draft] int64 target ids, ascending
    vocab_size: int  # the target's
    coverage: float  # fraction of the counted response tokens that are in ``ids``

    @property
    def d2t(self) -> torch.Tensor:  # [V_draft] offsets: target id = draft id + d2t[draft id]
        return self.ids - torch.arange(len(self.ids))

    @property
    def t2d(self) -> torch.Tensor:  # [V] bool: target ids the draft can emit
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask

    def as_dict(self) -> dict:
        return {"size": len(self.ids), "coverage": self.coverage}


def response_token_counts(tokens: torch.Tensor, spans: list[tuple[int, int]], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in the response spans ``(start, end)`` of ``tokens`` [N] -> [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for start, end in spans:
        counts += torch.bincount(tokens[start:end], minlength=vocab_size)
    return counts


def choose_vocabulary(counts: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> DraftVocabulary:
    """The ``size`` most frequent target ids of ``counts`` [V] (ties: the lower id), plus ``always`` (e.g. the end
    of turn tokens) in the same budget."""
    vocab_size = len(counts)
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {vocab_size}]")
    score = counts.double().clone()
    score[list(always)] = float("inf")
    order = torch.sort(-score, stable=True).indices[:size]  # stable: ties keep the lower id first
    ids = torch.sort(order).values
    return DraftVocabulary(ids, vocab_size, _coverage(counts, ids))


def _coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """The fraction of the counted tokens (``counts`` [V]) that are among ``ids`` [V_draft]."""
    total = int(counts.sum())
    return int(counts[ids].sum()) / total if total else 1.0


def vocabulary_of(draft, counts: torch.Tensor) -> DraftVocabulary:
    """A reduced-vocabulary draft's own vocabulary, its coverage counted on ``counts`` [V] (a continued draft
    keeps the vocabulary its Markov rows and LM head were trained over)."""
    ids = draft.to_target_ids(torch.arange(draft.config.output_vocab_size))
    return DraftVocabulary(ids, len(counts), _coverage(counts, ids))


def install_vocabulary(draft, vocabulary: DraftVocabulary, target_lm_head: torch.Tensor) -> None:
    """Give a reduced-vocabulary ``DSparkDraft`` its mapping and its LM head: the target's rows [V, hidden] of
    its tokens, frozen like the shared full head (so it predicts what the target's head would, over fewer tokens)."""
    if draft.config.output_vocab_size != len(vocabulary.ids):
        raise ValueError(f"draft vocabulary of {len(vocabulary.ids)} tokens for a draft of "
                         f"{draft.config.output_vocab_size}")
    with torch.no_grad():
        draft.d2t.copy_(vocabulary.d2t)
        draft.t2d.copy_(vocabulary.t2d)
        head = draft.own["lm_head"]
        head.weight.copy_(target_lm_head[vocabulary.ids].to(head.weight.dtype))
    head.weight.requires_grad_(False)


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    """Tokens a draft vocabulary always keeps: the ones that end a reply (a draft that cannot propose the end
    drafts past it)."""
    ids = {tokenizer.eos_token_id, *(getattr(tokenizer, "additional_eos_ids", None) or ())}
    return tuple(sorted(i for i in ids if i is not None))
