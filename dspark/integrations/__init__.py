"""Other engines: everything that touches vLLM internals, in one module (`vllm_compat`)."""
