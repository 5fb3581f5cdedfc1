"""Offline vLLM greedy decoding of chat prompts (run as a script by the vLLM tests, its own process and threads).

    python tests/vllm_offline.py ENGINE_ARGS_JSON MAX_TOKENS PROMPTS_JSON

ENGINE_ARGS_JSON: ``dspark.integrations.vllm_compat.engine_arguments`` of the served config (the replica's engine
settings); prints one JSON object: the replies' token ids, one list per prompt."""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from dspark.loader import encode_chat, load_tokenizer

if __name__ == "__main__":
    engine_args, max_tokens, texts = json.loads(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(**engine_args)
    tok = load_tokenizer(engine_args["model"])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    replies = []
    for text in texts:  # one at a time, as the server decodes them at concurrency 1
        ids = encode_chat(tok, [{"role": "user", "content": text}])
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        replies.append(list(out.outputs[0].token_ids))
    print(json.dumps(replies))
