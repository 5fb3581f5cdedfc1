"""Peers on this machine, one run: the same target, prompts and dtype through every engine a user could pick.

Systems: vLLM plain, vLLM + prompt lookup (its ``ngram`` proposer), vLLM + suffix decoding (its ``suffix`` method,
arctic-inference's suffix trees: ``make suffix`` builds it), vLLM + this project's DSpark proposer (the dspark
vLLM plugin, ``engine.vllm_speculation: dspark_plugin``, with the config's gate and scheduler), the same with the head
in the drafter actor (``engine.vllm_drafter: actor``: hidden states over gloo), this project's native engine plain and
with the DSpark head (the embedded default's engine settings: confidence scheduler, draft gate), ``transformers``
``generate``; each at batch 1 (one request at a time) and at concurrency 8 (eight requests decoded together: vLLM's and
the native engine's schedulers; ``transformers`` as left-padded batches of 8), greedy and at T=1 / top-p 0.95 (seeded
per request; ``--decodings`` adds T=1 unseeded, as a client that sends no seed is served). Then the served vLLM path
(``serve run`` with ``engine.backend: vllm``, the OpenAI API through this project's front door, ``dspark loadtest``
at concurrency 1, greedy) against offline vLLM at batch 1.

    python -m benchmarks.peers [--sets humaneval,gsm8k] [--per-set 30] [--max-tokens 256] [--dtype auto]
        [--draft-dtype bfloat16] [--only DSpark,ngram,served] [--out peers.json] [--plot peers.png]

Each vLLM system runs in its own process (its engine, its threads), one after another, as the engine the replica
serves (``dspark.builder.build_engine``: vLLM's engine core in process behind ``VllmEngine``, driven by its
``generate``); tokens/s is completion
tokens over wall time after one warm-up request. Greedy outputs are compared with vLLM plain's (exact engines
agree up to kernel near-ties: ``tests/test_vllm_backend.py`` counts them).

The full table (every system, 30 prompts x 256 tokens per set) takes about 5 h of a 2-core machine, longer than one
working session, and a machine's caches do not outlive it. So a run may measure part of the systems (``--only``) and
add itself to a runs file kept in git (``--runs docs/peers-runs.json``); vLLM plain, the baseline, is measured in
every run, so each system's ratio is against the baseline of its own run, on its own machine, never across runs.
``--combine`` renders the union: each system from the latest run that measured it, with that run's baseline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.report import REPO, SERVE_CONFIG, Served, _bin, machine, on_cpus
from dspark.builder import build_engine
from dspark.config import SamplingParams
from dspark.evaluation.prompt_sets import read_prompts
from dspark.loader import encode_chat, load_tokenizer
from dspark.schema import load_engine_config, write_variant
from dspark.training.prepare import prepare_target

CONCURRENCY = 8
# Each decoding: (temperature, top_p). T=1 rows are seeded per request unless the label says unseeded: a seeded
# sampled request is pinned (full blocks, no draft gate: RowParams.pinned), an unseeded one drafts as a client that
# sends no seed is served (the draft gate and the load-aware choices on). ``--decodings`` picks the labels to run.
TEMPERATURES = {"greedy": (0.0, 1.0), "T=1 top-p 0.95": (1.0, 0.95), "T=1 top-p 0.95 unseeded": (1.0, 0.95)}
DEFAULT_DECODINGS = ("greedy", "T=1 top-p 0.95")
TOP_P = 0.95


def _seed(label: str, i: int) -> int | None:
    return None if label.endswith("unseeded") else i


def _progress(name: str, done: int, total: int) -> None:
    print(f"\r[peers] {name:<44} {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)


def _row(name: str, outputs: list[list[int]], seconds: float, **extra) -> dict:
    tokens = sum(len(o) for o in outputs)
    return {"system": name, "completion_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "outputs": outputs, **extra}


def _timed(name: str, prompts: list[list[int]], one, batch) -> dict:
    """``one(prompt, index)`` at batch 1 and ``batch(prompts)`` at concurrency 8 (None: batch 1 only), after a
    warm-up request."""
    one(prompts[0], 0)
    rows = {}
    outputs, start = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        outputs.append(one(prompt, i))
        _progress(f"{name}, batch 1", i + 1, len(prompts))
    rows["batch 1"] = (outputs, time.perf_counter() - start)
    if batch is None:
        return rows
    start = time.perf_counter()
    outputs = batch(prompts)
    _progress(f"{name}, concurrency {CONCURRENCY}", len(prompts), len(prompts))
    rows[f"concurrency {CONCURRENCY}"] = (outputs, time.perf_counter() - start)
    return rows


def _pin(cpus: list[int]) -> None:
    """This process (and the processes and OpenMP threads it starts later) on ``cpus``, one thread each."""
    os.sched_setaffinity(0, set(cpus))
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    torch.set_num_threads(len(cpus))


# ------------------------------------------------------------------------------------------------ vLLM (own process)
def _vllm_worker(config_path: str, dtype: str, speculation: str, prompts: list[list[int]], max_tokens: int,
                 greedy_batch_1_only: bool, queue, drafter: str = "colocated", cpus: list[int] | None = None,
                 overlap: bool = True, draft_dtype: str | None = None, exact: bool | None = None,
                 temperatures: tuple[str, ...] = DEFAULT_DECODINGS, sources: str = "head") -> None:
    if cpus:  # before vLLM and its OpenMP threads start: they inherit the cores and the thread count
        _pin(cpus)
    from dspark.integrations.vllm_0_32.args import engine_env

    config = load_engine_config(config_path)
    engine = {"backend": "vllm", "vllm_speculation": speculation, "vllm_drafter": drafter,
              "vllm_draft_overlap": overlap, "max_num_seqs": CONCURRENCY}
    if exact is not None:  # engine.vllm_exact: shape-invariant bf16 kernels (None: as the config says)
        engine["vllm_exact"] = exact
    if speculation == "dspark_plugin":  # engine.draft_sources: head, lookup or hybrid
        engine["draft_sources"] = sources
    config = config.model_copy(update={
        "target": config.target.model_copy(update={"dtype": dtype}),
        "draft": config.draft.model_copy(update={"dtype": draft_dtype or dtype}),
        "engine": config.engine.model_copy(update=engine)})
    os.environ.update(engine_env(config))  # as the replica's engine: the engine core here, the kernels chosen
    from dspark.builder import build_engine

    host = None
    if drafter == "actor":  # the drafter actor of a served replica, on a local Ray cluster of this process
        import ray

        from actors.draft_actor import DrafterHostFactory

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        host = DrafterHostFactory(config)
    engine = build_engine(config, drafter_host=host)  # the replica's engine (dspark.builder), driven here
    llm = engine.llm
    results = {}
    for label, (temperature, top_p) in TEMPERATURES.items():
        if (greedy_batch_1_only and temperature) or label not in temperatures:
            continue

        def params(i: int, temperature=temperature, top_p=top_p, label=label) -> SamplingParams:
            return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=_seed(label, i))

        def one(prompt: list[int], i: int) -> list[int]:
            return engine.generate([prompt], params(i))[0].token_ids

        def batch(prompts: list[list[int]]) -> list[list[int]]:
            return [r.token_ids for r in engine.generate(prompts, [params(i) for i in range(len(prompts))])]

        before, split, by_source = _vllm_spec_counters(engine), _time_split(llm), _sources(llm)
        results[label] = _timed(f"vLLM {speculation} {label}", prompts, one, None if greedy_batch_1_only else batch)
        after = _vllm_spec_counters(engine)
        results[label + " spec"] = {k: after[k] - before[k] for k in after}
        if split is not None:
            results[label + " split"] = {k: v - split[k] for k, v in _time_split(llm).items()}
        if by_source is not None:  # our proposer's drafts by source (head, lookup), both modes of this temperature
            now = _sources(llm)
            results[label + " sources"] = {
                source: {"drafts": c["drafts"] - by_source[source]["drafts"],
                         "drafted_tokens": c["drafted_tokens"] - by_source[source]["drafted_tokens"],
                         "accepted_tokens": c["accepted_tokens"] - by_source[source]["accepted_tokens"],
                         "accepted_per_pos": [a - (by_source[source]["accepted_per_pos"][j]
                                                   if j < len(by_source[source]["accepted_per_pos"]) else 0)
                                              for j, a in enumerate(c["accepted_per_pos"])]}
                for source, c in now.items()}
    queue.put(results)


def _sources(llm) -> dict | None:
    """Our proposer's counters by draft source so far (``StepDrafterStats.sources``); None without it."""
    from dspark.integrations.vllm_0_32.remote_drafter import dspark_proposer

    proposer = dspark_proposer(llm)
    if proposer is None:
        return None
    return {source: st.as_dict() for source, st in proposer.step_drafter.stats.sources.items()}


def _time_split(llm) -> dict | None:
    """Our proposer's step timeline so far, seconds (``StepDrafterStats``): vLLM's own work (target), its waits for
    drafts (draft), the draft pass (drafter), the features' trip to an actor (transport), vLLM's work while an actor
    drafted (overlap); None without our proposer."""
    from dspark.integrations.vllm_0_32.remote_drafter import dspark_proposer

    proposer = dspark_proposer(llm)
    if proposer is None:
        return None
    st = proposer.step_drafter.stats
    return {"target": st.step_seconds, "draft": st.draft_seconds, "drafter": st.drafter_seconds,
            "transport": st.transport_seconds, "overlap": st.overlap_seconds, "steps": st.steps}


def _vllm_spec_counters(engine) -> dict:
    """vLLM's own counters (its ``SpecDecodingStats``, what it exports as ``vllm:spec_decode_num_drafts`` /
    ``..._num_accepted_tokens``), as the engine's stat logger sums them."""
    return {"drafts": float(engine.metrics.num_drafts), "accepted": float(engine.metrics.num_accepted_tokens)}


def vllm_system(config_path: Path, dtype: str, speculation: str, prompts, max_tokens: int,
                greedy_batch_1_only: bool = False, drafter: str = "colocated", cpus: list[int] | None = None,
                overlap: bool = True, draft_dtype: str | None = None, exact: bool | None = None,
                temperatures: tuple[str, ...] = DEFAULT_DECODINGS, sources: str = "head") -> dict:
    """``cpus``: the engine's process on those cores, one thread each (None: this process's cores); ``overlap``:
    a drafter actor drafts while vLLM finishes its step (``engine.vllm_draft_overlap``); ``draft_dtype``: the
    draft's (None: ``dtype``); ``exact``: ``engine.vllm_exact`` (None: the config's); ``temperatures``: the
    labels of ``TEMPERATURES`` to run."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_vllm_worker, args=(str(config_path), dtype, speculation, prompts, max_tokens,
                                                  greedy_batch_1_only, queue, drafter, cpus, overlap, draft_dtype,
                                                  exact, temperatures, sources))
    proc.start()
    while True:  # a worker that dies (a bad engine argument) must not leave the run waiting forever
        try:
            results = queue.get(timeout=5)
            break
        except Exception:
            if not proc.is_alive():
                raise RuntimeError(f"the vLLM {speculation} worker exited with {proc.exitcode}") from None
    proc.join()
    return results


# ------------------------------------------------------------------------------------------------ in this process
def native_system(config, speculate: bool, prompts, max_tokens: int,
                  temperatures: tuple[str, ...] = DEFAULT_DECODINGS) -> dict:
    engine = build_engine(config.model_copy(update={"engine": config.engine.model_copy(
        update={"max_num_seqs": CONCURRENCY})}), speculate=speculate, backend="native")
    results = {}
    for label, (temperature, top_p) in TEMPERATURES.items():
        if label not in temperatures:
            continue

        def params(i: int, temperature=temperature, top_p=top_p, label=label) -> SamplingParams:
            return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=_seed(label, i))

        def one(prompt, i):
            return engine.generate([prompt], params(i))[0].token_ids

        def batch(prompts):
            return [r.token_ids for r in engine.generate(prompts, [params(i) for i in range(len(prompts))])]

        before = (engine.metrics.num_drafts, engine.metrics.num_accepted_tokens)
        results[label] = _timed(f"native {'DSpark' if speculate else 'plain'} {label}", prompts, one, batch)
        results[label + " spec"] = {"drafts": engine.metrics.num_drafts - before[0],
                                    "accepted": engine.metrics.num_accepted_tokens - before[1]}
    return results


def transformers_system(config, prompts, max_tokens: int, eos: list[int],
                        temperatures: tuple[str, ...] = DEFAULT_DECODINGS) -> dict:
    import transformers

    path = str(config.resolve(config.target.path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, config.target.dtype)).eval()
    results = {}
    for label, (temperature, top_p) in TEMPERATURES.items():
        if label not in temperatures:
            continue
        sampled = {"do_sample": True, "temperature": temperature, "top_p": top_p}

        def generate(batch_ids: list[list[int]], seed: int, sample=sampled if temperature else {}) -> list[list[int]]:
            width = max(map(len, batch_ids))
            ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in batch_ids])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_ids])
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, eos_token_id=eos,
                                     pad_token_id=eos[0], **({"do_sample": False} | sample))
            rows = []
            for row in out[:, width:].tolist():
                cut = next((k for k, t in enumerate(row) if t in eos), len(row))
                rows.append(row[:cut])
            return rows

        def batch(prompts):
            return [o for s in range(0, len(prompts), CONCURRENCY)
                    for o in generate(prompts[s:s + CONCURRENCY], s)]

        results[label] = _timed(f"transformers generate {label}", prompts, lambda p, i: generate([p], i)[0], batch)
    return results


# ------------------------------------------------------------------------------------------------ served vLLM
def served_vllm(config_path: Path, dtype: str, texts: list[str], prompts, max_tokens: int, work: Path,
                engine_cpus: list[int] | None = None) -> dict:
    """``serve run`` with engine.backend vllm, greedy requests through the OpenAI API at concurrency 1; and offline
    vLLM at batch 1 again while the served application sits idle beside it (on a 2-core machine Ray's and Serve's
    processes take cycles from the engine's threads even idle: that column says how much of the gap is their
    presence rather than the served path's own work). ``engine_cpus``: the replica's engine on those cores
    (``runtime.engine_cpus``), ``serve run`` with Ray's and Serve's processes and the load generator on the others,
    and the offline run beside it on the same cores, one thread each: the same engine on the same cores, served
    and offline."""
    config = load_engine_config(config_path)
    others = set(range(os.cpu_count() or 1)) - set(engine_cpus) if engine_cpus else None
    variant = write_variant(config, work / "peers-served-vllm.json", target={"dtype": dtype},
                            engine={"backend": "vllm", "vllm_speculation": "off", "max_num_seqs": CONCURRENCY},
                            serving={"load_aware_speculation": False},
                            **({"runtime": {"engine_cpus": engine_cpus}} if engine_cpus else {}))
    serve_yaml = work / "serve-peers.yaml"
    serve_yaml.write_text(SERVE_CONFIG.format(config=variant))
    prompts_file = work / "peers-prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    report = work / "peers-served-load.json"
    with Served(serve_yaml, work / "serve-peers.log", cpus=others):
        subprocess.run([_bin("dspark"), "loadtest", "--dataset", str(prompts_file), "--concurrency", "1",
                        "--requests", str(len(texts)), "--max-tokens", str(max_tokens), "--temperature", "0",
                        "--top-p", "1.0", "--modes", "off", "--out", str(report)], cwd=REPO, check=True,
                       preexec_fn=on_cpus(others))
        beside = vllm_system(config_path, dtype, "off", prompts, max_tokens, greedy_batch_1_only=True,
                             cpus=engine_cpus)
    level = json.loads(report.read_text())["levels"][0]
    outputs, seconds = beside["greedy"]["batch 1"]
    return {"tok_s": level["throughput_tok_s"], "completion_tokens": level["output_tokens"],
            "seconds": level["wall_s"], "errors": level["errors"],
            "offline_beside_tok_s": sum(len(o) for o in outputs) / seconds}


# ------------------------------------------------------------------------------------------------ report
def _checkpointed(path: Path, key: dict, name: str, fn):
    """A system's results from ``path`` when an earlier, interrupted run with the same ``key`` (settings and
    machine) finished it; else measured now and added to ``path``, so a long run resumes where it stopped."""
    saved = json.loads(path.read_text()) if path.exists() else {}
    if saved.get("key") != key:
        saved = {"key": key, "systems": {}}
    if name in saved["systems"]:
        print(f"[peers] {name}: from {path} (an interrupted run of the same settings on this machine)",
              file=sys.stderr, flush=True)
        return saved["systems"][name]
    results = json.loads(json.dumps(fn()))  # tuples as lists: the same shape whether measured now or resumed
    saved["systems"][name] = results
    path.write_text(json.dumps(saved) + "\n")
    return results


def run(config_path: Path, sets: list[str], per_set: int, max_tokens: int, dtype: str, work: Path,
        only: list[str] | None = None, engine_cpus: list[int] | None = None,
        served_engine_cpus: list[int] | None = None, resume: bool = False, draft_dtype: str | None = None,
        decodings: tuple[str, ...] = DEFAULT_DECODINGS) -> dict:
    """``decodings``: the labels of ``TEMPERATURES`` each system runs. ``draft_dtype``: the DSpark rows' draft dtype
    where it differs from ``dtype`` (named in those rows; None: ``dtype``, as the config's ``auto`` resolves it with
    ``dtype: auto``). ``only``: run the systems whose names contain one of these (vLLM plain, the baseline, always
    runs; the served path only when 'served' is among them); None: everything. ``engine_cpus``: every engine
    computes on these cores with one thread each (the served one too: ``served_vllm``); None: on all of them.
    ``served_engine_cpus``: only the served path's engine (and its offline twin) on those cores. ``resume``: the
    systems an interrupted run with the same settings finished on this machine are read back from ``work``."""
    served_engine_cpus = served_engine_cpus or engine_cpus
    if served_engine_cpus and not set(range(os.cpu_count() or 1)) - set(served_engine_cpus):
        raise SystemExit("--engine-cpus / --served-engine-cpus must leave a core for serve run and the load generator")
    if engine_cpus:
        _pin(engine_cpus)  # the engines' processes (spawned) inherit both
    config = load_engine_config(config_path)
    if "DSPARK_CACHE" in config.target.path:
        prepare_target()
    config, _ = config.with_concrete_dtypes() if dtype == "auto" else (config.model_copy(update={
        part: getattr(config, part).model_copy(update={"dtype": dtype}) for part in ("target", "draft")}), None)
    if draft_dtype:
        config = config.model_copy(update={"draft": config.draft.model_copy(update={"dtype": draft_dtype})})
    dtype, draft_dtype = config.target.dtype, config.draft.dtype
    tokenizer = load_tokenizer(config.resolve(config.target.path))
    texts = [t for name in sets for t in read_prompts(name, per_set)]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    eos = sorted({tokenizer.eos_token_id} | set(getattr(tokenizer, "additional_eos_ids", []) or []))
    head = Path(config.draft.path).name  # the config's head, named in its rows (with its dtype where it differs)
    head += f", {draft_dtype} draft" if draft_dtype != dtype else ""

    def vllm(speculation: str, **options):
        return lambda: vllm_system(config_path, dtype, speculation, prompts, max_tokens, temperatures=decodings,
                                   **options)

    systems = {
        "vLLM plain": vllm("off"),
        "vLLM + ngram (prompt lookup, k=5)": vllm("ngram"),
        "vLLM + suffix (suffix decoding, arctic-inference 0.3.0)": vllm("suffix"),
        f"vLLM + DSpark ({head}, our proposer in vLLM)": vllm("dspark_plugin", draft_dtype=draft_dtype),
        f"vLLM + hybrid ({head} + prompt lookup, chosen per request and step)": vllm(
            "dspark_plugin", draft_dtype=draft_dtype, sources="hybrid"),
        "vLLM + lookup (our proposer, prompt lookup only)": vllm("dspark_plugin", draft_dtype=draft_dtype,
                                                                 sources="lookup"),
        f"vLLM + DSpark actor ({head}, drafter actor over gloo)": vllm("dspark_plugin", drafter="actor",
                                                                       draft_dtype=draft_dtype),
        f"vLLM + DSpark actor without overlap ({head}, vLLM waits for the drafts)": vllm(
            "dspark_plugin", drafter="actor", overlap=False, draft_dtype=draft_dtype),
        "native plain": lambda: native_system(config, False, prompts, max_tokens, decodings),
        f"native + DSpark ({head})": lambda: native_system(config, True, prompts, max_tokens, decodings),
        "transformers generate": lambda: transformers_system(config, prompts, max_tokens, eos, decodings),
    }
    checkpoint = work / "peers-partial.json"
    if not resume:
        checkpoint.unlink(missing_ok=True)
    key = {"config": str(config_path), "sets": sets, "per_set": per_set, "max_tokens": max_tokens, "dtype": dtype,
           "draft_dtype": draft_dtype, "engine_cpus": engine_cpus, "machine": machine(),
           **({"decodings": list(decodings)} if tuple(decodings) != DEFAULT_DECODINGS else {})}
    rows = []
    for name, fn in systems.items():
        if only is not None and name != "vLLM plain" and not any(o in name for o in only):
            continue
        results = _checkpointed(checkpoint, key, name, fn)
        for label in TEMPERATURES:
            if label not in results:
                continue
            spec = results.get(label + " spec")
            for mode, (outputs, seconds) in results[label].items():
                outputs = [[t for t in o if t not in eos] for o in outputs]
                tau = None
                if spec and spec["drafts"]:
                    tau = 1 + spec["accepted"] / spec["drafts"]  # both modes pooled: drafts of this temperature
                rows.append(_row(name, outputs, seconds, mode=mode, temperature=label, tau=tau,
                                 split=results.get(label + " split")))
                if results.get(label + " sources"):
                    rows[-1]["sources"] = results[label + " sources"]  # both modes pooled, as tau
    reference = {(r["mode"], r["temperature"]): r["outputs"] for r in rows if r["system"] == "vLLM plain"}
    for r in rows:
        base = next(x for x in rows if x["system"] == "vLLM plain" and x["mode"] == r["mode"]
                    and x["temperature"] == r["temperature"])
        r["vs_vllm_plain"] = r["tok_s"] / base["tok_s"]
        if r["temperature"] == "greedy":
            r["greedy_equal_to_vllm_plain"] = sum(a == b for a, b in zip(r["outputs"],
                                                                        reference[(r["mode"], "greedy")]))
        del r["outputs"]
    served = None
    if only is None or "served" in only:
        served = served_vllm(config_path, dtype, texts, prompts, max_tokens, work, served_engine_cpus)
        offline = next(r for r in rows if r["system"] == "vLLM plain" and r["mode"] == "batch 1"
                       and r["temperature"] == "greedy")
        served["vs_offline_vllm_batch_1"] = served["tok_s"] / offline["tok_s"]
        served["vs_offline_beside"] = served["tok_s"] / served["offline_beside_tok_s"]
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "dtype": dtype, "draft_dtype": draft_dtype,
            "sets": sets, "per_set": per_set, "prompts": len(prompts),
            "max_tokens": max_tokens, "engine_cpus": engine_cpus, "served_engine_cpus": served_engine_cpus,
            "rows": rows, "served_vllm": served}


def table(report: dict) -> str:
    combined = report.get("combined", False)
    lines = [f"{report['prompts']} prompts ({', '.join(report['sets'])}, {report['per_set']} each) x up to "
             f"{report['max_tokens']} tokens, {report['dtype']}; {report['machine']}"
             + (f"; engines on cores {report['engine_cpus']} (one thread each), serve run and the load generator "
                "on the others" if report.get("engine_cpus") else ""), ""]
    if combined:
        lines += ["Rows come from several runs (column *run*); each ratio and each equality count is against vLLM "
                  "plain measured in the same run, on the same machine (its tokens/s in *run's vLLM plain*); "
                  "tokens/s of different runs are not comparable.", "",
                  "| system | run | mode | decoding | tok/s | run's vLLM plain tok/s | vs vLLM plain | τ (pooled) "
                  "| greedy outputs equal to vLLM plain |", "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    else:
        lines += ["| system | mode | decoding | tok/s | vs vLLM plain | τ (pooled) | greedy outputs equal to vLLM "
                  "plain |", "|---|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        equal = f"{r['greedy_equal_to_vllm_plain']}/{report['prompts']}" if "greedy_equal_to_vllm_plain" in r else ""
        tau = f"{r['tau']:.2f}" if r.get("tau") else ""
        run = f" {r['run']} |" if combined else ""
        base = f" {r['baseline_tok_s']:.1f} |" if combined else ""
        lines.append(f"| {r['system']} |{run} {r['mode']} | {r['temperature']} | {r['tok_s']:.1f} |{base} "
                     f"{r['vs_vllm_plain']:.2f}x | {tau} | {equal} |")
    splits = {(r["system"], r["temperature"]): r["split"] for r in report["rows"] if r.get("split")}
    if splits:
        lines += ["", "Where a DSpark-in-vLLM system's step time went (both modes of a decoding pooled), ms per step: "
                  "vLLM's own work, its wait for drafts, the draft pass, the features' trip to the actor, and vLLM's "
                  "work done while the actor drafted (overlap).", "",
                  "| system | decoding | steps | vLLM | wait for drafts | draft pass | transport | overlapped |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for (system, temperature), sp in splits.items():
            ms = {k: 1e3 * sp[k] / max(sp["steps"], 1) for k in ("target", "draft", "drafter", "transport",
                                                                  "overlap")}
            lines.append(f"| {system} | {temperature} | {sp['steps']} | {ms['target']:.1f} | {ms['draft']:.1f} | "
                         f"{ms['drafter']:.1f} | {ms['transport']:.1f} | {ms['overlap']:.1f} |")
    sourced = {(r["system"], r["temperature"]): r["sources"] for r in report["rows"] if r.get("sources")}
    if sourced:
        lines += ["", "Our proposer's drafts by source (both modes of a decoding pooled): share of the drafted steps, "
                  "acceptance length of a step with that source's draft (τ), and the acceptance rate at each draft "
                  "position (drafts that kept at least j tokens / drafts).", "",
                  "| system | decoding | source | drafts | share | τ | acceptance by position |",
                  "|---|---|---|---:|---:|---:|---|"]
        for (system, temperature), by_source in sourced.items():
            total = sum(c["drafts"] for c in by_source.values())
            for source, c in by_source.items():
                if not c["drafts"]:
                    continue
                rates = " ".join(f"{a / c['drafts']:.2f}" for a in c["accepted_per_pos"])
                lines.append(f"| {system} | {temperature} | {source} | {c['drafts']} | {c['drafts'] / total:.0%} | "
                             f"{1 + c['accepted_tokens'] / c['drafts']:.2f} | {rates} |")
    s = report["served_vllm"]
    if s is None:
        return "\n".join(lines)
    cores = report.get("served_engine_cpus")
    twin = f" (its engine on the served engine's cores {cores}, one thread each)" if cores else ""
    if combined:
        lines += ["", f"The served path below is run {report['served_run']}'s."]
    lines += ["", "| served vLLM path (serve run, OpenAI API streaming, concurrency 1, greedy) | tok/s "
              "| served / that |",
              "|---|---:|---:|",
              f"| served{' (runtime.engine_cpus: ' + str(cores) + ')' if cores else ''} | {s['tok_s']:.1f} | |",
              f"| offline vLLM, batch 1 (above) | {s['tok_s'] / s['vs_offline_vllm_batch_1']:.1f} | "
              f"{s['vs_offline_vllm_batch_1']:.2f}x |",
              f"| offline vLLM, batch 1, with the served app idle beside it{twin} | {s['offline_beside_tok_s']:.1f} | "
              f"{s['vs_offline_beside']:.2f}x |", "",
              f"Errors in the served run: {sum(s['errors'].values())}."]
    return "\n".join(lines)


SETTINGS = ("sets", "per_set", "max_tokens", "dtype")


def add_run(runs_file: Path, report: dict) -> dict:
    """``report`` (outputs already dropped) appended to ``runs_file``; returns the file's content."""
    runs = json.loads(runs_file.read_text()) if runs_file.exists() else {"runs": []}
    runs["runs"].append({k: v for k, v in report.items() if k != "markdown"})
    runs_file.write_text(json.dumps(runs, indent=1) + "\n")
    return runs


def combine(runs: dict) -> dict:
    """One report from several runs of the same settings (those of the latest run): each system's rows from the
    latest run that measured it, their ratios (``vs_vllm_plain``) as measured against that run's own vLLM plain, the
    served path from the latest run that served; ``run`` on each row indexes ``runs`` (1-based, as printed)."""
    if not runs["runs"]:
        raise SystemExit("no runs to combine")
    latest = runs["runs"][-1]
    same = [(i, r) for i, r in enumerate(runs["runs"], 1) if all(r.get(k) == latest.get(k) for k in SETTINGS)]
    chosen: dict[str, int] = {}
    for i, r in same:
        for row in r["rows"]:
            chosen[row["system"]] = i
    rows, baseline = [], {}
    for system, i in chosen.items():
        run_rows = runs["runs"][i - 1]["rows"]
        for row in run_rows:
            if row["system"] == system:
                base = next((x for x in run_rows if x["system"] == "vLLM plain" and x["mode"] == row["mode"]
                             and x["temperature"] == row["temperature"]), None)
                if base is None:
                    raise SystemExit(f"run {i} has no vLLM plain row for {row['mode']}, {row['temperature']}")
                rows.append({**row, "run": i, "baseline_tok_s": base["tok_s"]})
                baseline[i] = True
    served = next(((i, r["served_vllm"]) for i, r in reversed(same) if r.get("served_vllm")), None)
    used = sorted(set(baseline) | ({served[0]} if served else set()))
    return {**{k: latest[k] for k in SETTINGS}, "prompts": latest["prompts"], "combined": True,
            "runs": {i: {k: runs["runs"][i - 1].get(k) for k in ("date", "machine", "engine_cpus",
                                                                  "served_engine_cpus")} for i in used},
            "rows": rows, "served_vllm": served[1] if served else None, "served_run": served[0] if served else None,
            "engine_cpus": None, "served_engine_cpus": served and runs["runs"][served[0] - 1].get("served_engine_cpus"),
            "machine": "; ".join(f"run {i}: {runs['runs'][i - 1].get('date', '?')}, "
                                 f"{runs['runs'][i - 1]['machine']}" for i in used)}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in report["rows"]))
    present = {r["temperature"] for r in report["rows"]}
    panels = [(m, t) for m in ("batch 1", f"concurrency {CONCURRENCY}") for t in TEMPERATURES if t in present]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), sharey=False)
    key = "vs_vllm_plain" if report.get("combined") else "tok_s"  # tokens/s of different runs do not compare
    for ax, (mode, temp) in zip(axes, panels):
        values = [next((r[key] for r in report["rows"] if r["system"] == s and r["mode"] == mode
                        and r["temperature"] == temp), 0.0) for s in systems]
        ax.barh(range(len(systems)), values, color=[f"C{i}" for i in range(len(systems))])
        ax.set_yticks(range(len(systems)), systems if ax is axes[0] else [""] * len(systems), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{mode}, {temp}", fontsize=9)
        ax.set_xlabel("x vLLM plain of the same run" if key == "vs_vllm_plain" else "output tokens/s")
        if key == "vs_vllm_plain":
            ax.axvline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(f"Peers: {report['prompts']} prompts x {report['max_tokens']} tokens, {report['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--sets", default="humaneval,gsm8k", help="comma-separated prompt sets (benchmarks/data/)")
    parser.add_argument("--per-set", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="every engine's target, and the draft unless --draft-dtype")
    parser.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16"],
                        help="the DSpark rows' draft (named in them where it differs from the target's); default: "
                             "--dtype")
    parser.add_argument("--work", default=str(REPO / "out" / "peers"), help="folder for configs and logs")
    parser.add_argument("--out", default="peers.json")
    parser.add_argument("--plot", default="peers.png")
    parser.add_argument("--engine-cpus", default=None, help="comma-separated cores every engine computes on, one "
                                                             "thread each (runtime.engine_cpus for the served one, "
                                                             "its serve run on the other cores); default: all")
    parser.add_argument("--served-engine-cpus", default=None, help="comma-separated cores for the served path's "
                        "engine only (runtime.engine_cpus) and its offline twin; the other rows on all cores")
    parser.add_argument("--resume", action="store_true", help="read back the systems an interrupted run with the "
                        "same settings finished on this machine (WORK/peers-partial.json)")
    parser.add_argument("--runs", default=None, help="a runs file (docs/peers-runs.json) to add this run to; "
                        "--out/--plot then render the runs combined")
    parser.add_argument("--combine", action="store_true", help="measure nothing: render --runs combined into "
                        "--out/--plot")
    parser.add_argument("--only", default=None, help="comma-separated parts of system names to run (vLLM plain "
                                                     "always runs; 'served' for the served path); default: all")
    parser.add_argument("--decodings", default=",".join(DEFAULT_DECODINGS),
                        help=f"comma-separated decodings to run, of: {', '.join(TEMPERATURES)}")
    args = parser.parse_args(argv)
    decodings = tuple(d.strip() for d in args.decodings.split(","))
    if unknown := [d for d in decodings if d not in TEMPERATURES]:
        parser.error(f"--decodings: unknown {unknown}; known: {', '.join(TEMPERATURES)}")
    if args.combine:
        if not args.runs:
            parser.error("--combine needs --runs")
        return _write(combine(json.loads(Path(args.runs).read_text())), args)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report = run(Path(args.config), args.sets.split(","), args.per_set, args.max_tokens, args.dtype, work,
                 args.only.split(",") if args.only else None,
                 [int(c) for c in args.engine_cpus.split(",")] if args.engine_cpus else None,
                 [int(c) for c in args.served_engine_cpus.split(",")] if args.served_engine_cpus else None,
                 args.resume, args.draft_dtype, decodings)
    if args.runs:
        print(table(report) + "\n")  # this run alone, then the runs file combined
        report = combine(add_run(Path(args.runs), report))
    return _write(report, args)


def _write(report: dict, args) -> int:
    report["markdown"] = table(report)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    plot(report, Path(args.plot))
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
