"""The ``dspark`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from dspark.config import ConfigError


def _generate(args: argparse.Namespace) -> int:
    from dspark.loader import build_engine, encode_prompt
    from dspark.schema import load_engine_config, sampling_from_values

    cfg = load_engine_config(args.config)
    params = sampling_from_values(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop=args.stop or None)
    engine = build_engine(cfg, speculate=False if args.no_spec else None, threads=args.threads)
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
                          "finish_reason": result.finish_reason, "metrics": result.metrics.to_dict()}))
    else:
        print()
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from dspark.prepare import prepare_target, sanity_check

    out = prepare_target(args.out, force=args.force)
    print(f"target ready: {out}")
    print(f"sanity check: 'The capital of France is' -> {sanity_check(out)!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt with the in-process engine")
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
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, ids and metrics")
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    gen.set_defaults(func=_generate)
    prep = sub.add_parser("prepare", help="convert the embedded default target (SmolLM2-135M-Instruct) once")
    prep.add_argument("--out", default=None, help="checkpoint directory (default ~/.cache/dspark/...)")
    prep.add_argument("--force", action="store_true", help="convert again even if already prepared")
    prep.set_defaults(func=_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
