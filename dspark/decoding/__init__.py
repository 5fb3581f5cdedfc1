"""One decoding round and the reference engine around it: sampling and verification, the prefix scheduler, the
draft gate, who runs the draft and target passes, the paged KV cache, requests and their metrics."""
