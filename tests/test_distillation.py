"""Distillation over a corpus of token ids: the corpus format, and a run interrupted and resumed (from the local
checkpoint, or from the committed bf16 state alone) reading the same rows with the same anchors in the same order
as a run that never stopped."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dspark.evaluation.prompt_sets import PROMPT_SETS_DIR
from dspark.jsonl import read_jsonl
from dspark.training import corpus
from dspark.training.distillation import CorpusRows, DistillConfig, Distiller, anchor_picker
from dspark.training.recipe import DraftArchSpec, draft_config

from conftest import stdlib_texts


def _documents(rng: random.Random):
    for i, text in enumerate(stdlib_texts(12)):
        yield corpus.Document(f"Show module number {i}.", text[:3000])


TINY_SOURCE = corpus.Source("tiny", "PSF-2.0", "stdlib excerpts", "code", _documents)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory, tiny_tokenizer) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    corpus.build_source(TINY_SOURCE, tiny_tokenizer, root, PROMPT_SETS_DIR, seq_len=96, shard_sequences=24,
                        heldout_sequences=2, log=lambda *_: None)
    corpus.build_source(replace(TINY_SOURCE, name="tiny-two"), tiny_tokenizer, root, PROMPT_SETS_DIR, seed=1,
                        seq_len=96, shard_sequences=16, heldout_sequences=2, log=lambda *_: None)
    return root


def test_the_corpus_packs_chat_exchanges_into_full_rows_with_their_reply_spans(tiny_corpus, tiny_tokenizer):
    manifest = json.loads((tiny_corpus / "tiny" / "manifest.json").read_text())
    assert manifest["licence"] == "PSF-2.0" and len(manifest["shards"]) >= 2 and corpus.verify(tiny_corpus) == []
    ids, spans = corpus.read_shard(tiny_corpus / "tiny" / manifest["shards"][0]["file"])
    assert ids.shape == (manifest["shards"][0]["sequences"], 96) and ids.dtype.name == "uint16"
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    for row, first, last in spans.tolist():
        assert ids[row, last] == end  # a reply ends at its end-of-turn token
        assert start not in ids[row, first:last].tolist()  # and holds no template token
        header = tiny_tokenizer.decode(ids[row, max(0, first - 8): first].tolist())
        assert "assistant" in header
    (tiny_corpus / "tiny" / manifest["shards"][0]["file"]).write_bytes(b"tampered")
    try:
        assert corpus.verify(tiny_corpus) == [str(tiny_corpus / "tiny" / manifest["shards"][0]["file"])]
    finally:
        corpus.build_source(TINY_SOURCE, tiny_tokenizer, tiny_corpus, PROMPT_SETS_DIR, seq_len=96,
                            shard_sequences=24, heldout_sequences=2, log=lambda *_: None)


def test_anchors_stay_inside_replies_and_blocks_stop_at_their_reply_end():
    spans = [torch.tensor([[5, 9], [20, 30]]).numpy()]
    pick = anchor_picker(spans, 40, 50, random.Random(0))
    anchor, label_index, valid = pick(0, 4)
    assert set(pick.draws[0]) == set(range(4, 9)) | set(range(19, 30))  # every candidate drawn once
    for a, labels, ok in zip(anchor.tolist(), label_index.tolist(), valid.tolist()):
        end = 9 if a < 9 else 30
        assert [lab <= end for lab in labels] == ok


def _distiller(tiny_target, corpus_root: Path, work: Path, max_steps: int) -> Distiller:
    ids = (0, 2, 3)
    cfg = draft_config(tiny_target.config, DraftArchSpec(num_layers=1, target_layer_ids=list(ids), block_size=3,
                                                         markov_rank=16, mask_token_id=3, draft_vocab_size=128),
                       "tiny")
    train = DistillConfig(seqs_per_step=2, anchors_per_seq=5, lr=1e-3, warmup=2, vocab_rows=4, heldout_per_source=1,
                          eval_anchors=6, ablation_tokens=96 * 2 * 3, max_steps=max_steps, checkpoint_s=1e9,
                          export_s=1e9, schedule_tokens=96 * 2 * 8)
    distiller = Distiller(tiny_target, tiny_target, CorpusRows(corpus_root), cfg, train, work / "local",
                          work / "state", (2,), log=lambda *_: None)
    distiller.trace = []
    return distiller


def test_an_interrupted_run_resumes_on_the_same_rows_and_anchors_in_the_same_order(tmp_path, tiny_target,
                                                                                     tiny_corpus):
    whole = _distiller(tiny_target, tiny_corpus, tmp_path / "whole", 7)
    whole.run()
    assert len(whole.trace) == 7 and "no-markov" not in whole.heads  # the ablation stopped after 3 steps' tokens
    first = _distiller(tiny_target, tiny_corpus, tmp_path / "cut", 3)
    first.run()
    (tmp_path / "cut-committed").mkdir()
    shutil.copytree(tmp_path / "cut" / "state", tmp_path / "cut-committed" / "state")  # the committed state only
    second = _distiller(tiny_target, tiny_corpus, tmp_path / "cut", 7)  # resumes from the local checkpoint
    second.run()
    assert first.trace + second.trace == whole.trace
    for name in whole.heads:  # fp32 weights and optimiser states carried over: the same training
        for (key, a), b in zip(whole.heads[name].draft.state_dict().items(),
                               second.heads[name].draft.state_dict().values()):
            assert torch.allclose(a.float(), b.float(), atol=1e-5), (name, key)
    from_git = _distiller(tiny_target, tiny_corpus, tmp_path / "cut-committed", 7)
    assert from_git.state["optimizer_since"] == 3  # the optimisers restart, with a warm-up
    from_git.run()
    assert first.trace + from_git.trace == whole.trace
    curve = read_jsonl(tmp_path / "whole" / "state" / "curve.jsonl")
    assert [p["step"] for p in curve] == [0, 3, 7]  # the ablation's last point where it stops, at step 3
    assert [set(p["heads"]) for p in curve] == [{"dspark", "control", "no-markov"}] * 2 + [{"dspark", "control"}]
    state = json.loads((tmp_path / "whole" / "state" / "state.json").read_text())
    assert state["step"] == 7 and state["tokens_read"] == 7 * 2 * 96 and state["heads"] == ["control", "dspark"]
    assert sum(state["consumed"].values()) == 14


def test_a_pretokenized_exchange_is_packed_with_its_own_ids(tiny_tokenizer):
    """The target's own responses keep the ids it wrote: header and reply go in as they are."""
    packer = corpus.Packer(tiny_tokenizer, seq_len=64)
    header, reply = (1, 40, 41, 42), tuple(range(50, 70))
    packer.add(corpus.Document("p", "r", ids=(header, reply)))
    packer._close_row(fill=True)
    ids, spans = packer.take(1)
    assert ids[0, :24].tolist() == list(header + reply)
    assert spans.tolist() == [[0, 4, 24]] and ids[0, 24] == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_the_target_responses_travel_in_git_and_a_fresh_machine_continues_them(tmp_path, monkeypatch):
    """``dspark corpus build`` keeps the responses file beside the target-responses shards (xz, sha256 in the
    manifest, complete rows only); on a machine without the file (a fresh one) the archive starts it again, so
    ``respond`` skips the prompts answered before; an existing file is never overwritten."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}, {"prompt_ids": [6], "response_ids": [7, 8, 9]}]
    path = corpus.responses_file()
    path.parent.mkdir(parents=True)
    complete = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(complete + '{"prompt_ids": [10')  # a run killed mid-row
    root = tmp_path / "data"
    entry = corpus.archive_responses(root)
    assert entry["rows"] == 2 and entry["file"] == corpus.RESPONSES_ARCHIVE
    heldout = root / "target-responses" / "heldout.npz.xz"
    heldout.write_bytes(b"rows")
    (root / "target-responses" / "manifest.json").write_text(json.dumps(
        {"heldout": {"file": heldout.name, "sha256": hashlib.sha256(b"rows").hexdigest()}, "shards": [],
         "responses": entry}))
    assert corpus.verify(root) == []
    assert not corpus.restore_responses(root)  # the file is there: left as it is
    path.unlink()
    assert corpus.restore_responses(root) and path.read_text() == complete
    (root / "target-responses" / corpus.RESPONSES_ARCHIVE).write_bytes(b"changed")
    assert corpus.verify(root) == [str(root / "target-responses" / corpus.RESPONSES_ARCHIVE)]
