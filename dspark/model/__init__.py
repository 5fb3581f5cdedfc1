"""The draft head and the target models: layers and attention (GQA, MLA, sliding windows), the DSpark draft model,
the native target (dense, MLA, MoE, FP8), Kimi-K3's shapes, tensor parallelism."""
