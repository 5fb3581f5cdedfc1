"""Offline vLLM greedy decoding of chat prompts (run as a script by tests/test_vllm_backend.py): prints the replies
as one JSON list. Arguments: target path, dtype, max_model_len, max_num_seqs, max_tokens, prompts..."""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from dspark.loader import encode_chat, load_tokenizer

if __name__ == "__main__":
    path, dtype, max_len, max_seqs, max_tokens, *texts = sys.argv[1:]
    llm = LLM(model=path, tokenizer=path, dtype=dtype, max_model_len=int(max_len), max_num_seqs=int(max_seqs),
              enforce_eager=True, seed=0, enable_prefix_caching=False)
    tok = load_tokenizer(path)
    params = SamplingParams(max_tokens=int(max_tokens), temperature=0.0)
    replies = []
    for text in texts:  # one at a time, as the server decodes them at concurrency 1
        ids = encode_chat(tok, [{"role": "user", "content": text}])
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        replies.append(tok.decode(list(out.outputs[0].token_ids), skip_special_tokens=True))
    print(json.dumps(replies))
