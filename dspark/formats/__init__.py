"""Checkpoint IO: draft checkpoints in the layouts vLLM, speculators and SGLang read; target checkpoints."""
