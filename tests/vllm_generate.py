"""Offline vLLM generation of token-id prompts (run as a script by the vLLM tests: its own process and threads).

    python tests/vllm_generate.py REQUEST_JSON_FILE

REQUEST_JSON_FILE: {"engine_args": ..., "prompts": [[ids]], "params": [{SamplingParams kwargs}] (one per prompt, or
one for all), "concurrency": [1, N, ...] (one run of all prompts per entry, in turn, on the one engine: 1 = one
request at a time, N = all submitted together, vLLM batching up to max_num_seqs), "broken_draft_probs": false (true:
every row's, "lookup": the lookup rows' only), "drafter_actor": null or a serving config (engine.vllm_drafter: actor)
whose drafter actor our proposer drafts through (a local Ray cluster of this process's own), "rank_digests": false}.
Prints one JSON object, {"runs": [...]}, one entry per run: "outputs" (token ids per prompt), "spec" (vLLM's
spec_decode counters of that run), "proposer" (the DSpark proposer's own counters of that run, when one drafted,
with "collects" and "after_outputs": see ``CollectTiming``); with "rank_digests", "ranks": per tensor-parallel rank
of the engine, a digest of what its DSpark proposer saw and gave each step, and the number of steps.
One engine for several runs saves a process start and an engine build per run (~25 s each on 2 CPU cores).

``broken_draft_probs`` makes the DSpark proposer report uniform draft distributions instead of the ones it sampled
from: the deliberately broken proposer a lossless test must catch.
"""

import hashlib
import json
import sys
from dataclasses import asdict, replace

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from dspark.integrations import step_drafter
from dspark.integrations.vllm_0_32.remote_drafter import WorkerDrafter, dspark_proposer


def break_draft_probs(rows: str = "all") -> None:
    """``rows``: "all" reports every row's draft distribution as uniform; "lookup" only the rows whose draft came from
    prompt lookup (a hybrid that accepts lookup tokens without the target's probability)."""
    collect = step_drafter.StepDrafter.collect  # every step's drafts pass here (propose, and submit + collect)

    def lying(self):
        out = collect(self)
        lookup = [i for i, rid in enumerate(self._row_ids) if self._sent_sources.get(rid) == "lookup"]
        if out.draft_probs is None and (rows == "all" or not lookup):
            return out
        if out.draft_probs is None:  # a step of lookup drafts only sends none (one-point distributions): lie densely
            shape = (len(out.tokens), self.block_size, self.vocab_size)
            out = replace(out, draft_probs=torch.zeros(shape))
        uniform = out.draft_probs.new_full(out.draft_probs.shape[1:], 1 / out.draft_probs.shape[-1])
        probs = out.draft_probs.clone()
        for i, rid in enumerate(self._row_ids):
            if rows == "all" or self._sent_sources.get(rid) == rows:
                probs[i] = uniform
        return replace(out, draft_probs=probs)

    step_drafter.StepDrafter.collect = lying


class CollectTiming:
    """When the DSpark proposer's drafts are collected relative to vLLM's output processing: a collect after the
    engine has turned a step into request outputs (``OutputProcessor.process_outputs`` ran between the step's
    submit and its collect) is one the engine core deferred to its next step (the overlap); a synchronous proposer
    collects within the step, before any."""

    def __init__(self):
        from vllm.v1.engine.output_processor import OutputProcessor

        self.outputs = self.at_submit = 0
        self.counts = {"collects": 0, "after_outputs": 0}
        process, submit, collect = OutputProcessor.process_outputs, step_drafter.StepDrafter.submit, \
            step_drafter.StepDrafter.collect

        def process_outputs(processor, *args, **kwargs):
            self.outputs += 1
            return process(processor, *args, **kwargs)

        def submitted(drafter, *args, **kwargs):
            self.at_submit = self.outputs
            return submit(drafter, *args, **kwargs)

        def collected(drafter):
            self.counts["collects"] += 1
            self.counts["after_outputs"] += self.outputs > self.at_submit
            return collect(drafter)

        OutputProcessor.process_outputs = process_outputs
        step_drafter.StepDrafter.submit, step_drafter.StepDrafter.collect = submitted, collected


def spec_counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in metric.values]
    return out


def since(after: dict, before: dict) -> dict:
    """Counters ``after`` minus ``before`` (numbers, and lists of numbers element by element)."""
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, list):
            old = old or []
            out[key] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value - (old or 0)
        else:
            out[key] = value
    return out


def proposer_stats(llm, host=None) -> dict | None:
    """The proposer's counters: in this process, or (tensor parallelism) rank 0's, through the engine's view."""
    if isinstance(host, WorkerDrafter):
        host.refresh()
        return asdict(host.stats)
    proposer = dspark_proposer(llm)
    return asdict(proposer.step_drafter.stats) if proposer else None


def digest_each_step(worker) -> None:
    """In each of the engine's workers: a running digest of what its DSpark proposer was given at every step, the
    rows and the tokens the rank's own rejection sampler accepted and sampled (the rank's view of every sequence),
    and of the draft ids it handed that sampler for the next step."""
    proposer = worker.model_runner.drafter
    base = proposer.propose_step
    proposer.digest, proposer.digested_steps = hashlib.sha256(), 0

    def propose_step(runner, scheduler_output, sampled_token_ids, aux_hidden_states):
        tokens, probs, req_ids = base(runner, scheduler_output, sampled_token_ids, aux_hidden_states)
        proposer.digest.update(repr((list(req_ids), [list(t) for t in sampled_token_ids], tokens)).encode())
        proposer.digested_steps += 1
        return tokens, probs, req_ids

    proposer.propose_step = propose_step


def step_digest(worker) -> list:
    proposer = worker.model_runner.drafter
    return [proposer.digest.hexdigest(), proposer.digested_steps]


if __name__ == "__main__":
    request = json.loads(open(sys.argv[1]).read())
    if request.get("broken_draft_probs"):
        break_draft_probs("lookup" if request["broken_draft_probs"] == "lookup" else "all")
    timing = CollectTiming()
    host = None
    llm = LLM(**request["engine_args"], disable_log_stats=False)
    if request.get("drafter_actor"):
        import ray

        from actors.draft_actor import DrafterHostFactory
        from dspark.integrations.vllm_0_32.remote_drafter import attach_remote_drafter
        from dspark.schema import EngineFileConfig

        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        # with tensor parallelism built in rank 0's worker, which joins this cluster
        host = attach_remote_drafter(llm, DrafterHostFactory(EngineFileConfig(**request["drafter_actor"])))
    if request.get("rank_digests"):
        llm.collective_rpc(digest_each_step)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    params = [SamplingParams(**p) for p in request["params"]]
    params = params * len(prompts) if len(params) == 1 else params
    runs = []
    for concurrency in request["concurrency"]:
        spec, proposer = spec_counters(llm), proposer_stats(llm, host)
        if proposer is not None:
            proposer.update(timing.counts)
        if concurrency == 1:
            outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        after = proposer_stats(llm, host)
        if after is not None:
            after.update(timing.counts)
        runs.append({"outputs": [list(o.outputs[0].token_ids) for o in outs], "spec": since(spec_counters(llm), spec),
                     "proposer": since(after, proposer or {}) if after is not None else None})
    channel = None
    if request.get("drafter_actor"):  # the feature channel's messages: sent, and held by the host undelivered
        channel = {"sent": host.sent.messages,
                   "undelivered": None if isinstance(host, WorkerDrafter) else host.remote.channel.undelivered}
    ranks = llm.collective_rpc(step_digest) if request.get("rank_digests") else None
    print(json.dumps({"runs": runs, "channel": channel, "ranks": ranks}))
