"""Other engines: what touches vLLM internals lives in the package named for its vLLM version (`vllm_0_32`)."""
