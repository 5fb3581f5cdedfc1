"""Loading a target checkpoint shard by shard: each rank reads only its own slice of every tensor."""

from __future__ import annotations

import pytest
import torch

from dspark.config import ConfigError
from dspark.formats.target_checkpoint import CheckpointReader, ShardSpec, load_target
from dspark.model.fp8 import FP8Linear, dequantize
from dspark.model.tensor_parallel import shard_target
from dspark.testing import make_tiny_deepseek, make_tiny_target, quantize_checkpoint


def no_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_target_dir):
    """name -> (path, dtype): GQA Llama and Qwen2 (q/k/v biases), a DeepSeek-V3 split over files, its FP8 copy."""
    from tests.conftest import stdlib_texts

    root = tmp_path_factory.mktemp("checkpoints")
    qwen2 = make_tiny_target(root / "qwen2", stdlib_texts(10), model_type="qwen2", vocab_size=300,
                             dtype=torch.float64)
    deepseek, _ = make_tiny_deepseek(root / "deepseek", tiny_target_dir, max_shard_size="60KB")
    assert len(list(deepseek.glob("*.safetensors"))) > 2 and (deepseek / "model.safetensors.index.json").is_file()
    # 32x32 blocks: the TP=2 halves of q_b (48 rows) and kv_b (32 rows of 64) start inside a block
    quantize_checkpoint(deepseek, root / "deepseek-fp8", (32, 32))
    return {"llama": (tiny_target_dir, "float64"), "qwen2": (qwen2, "float64"), "deepseek": (deepseek, "float32"),
            "deepseek-fp8": (root / "deepseek-fp8", "float32")}


def stored_bytes(model: torch.nn.Module) -> int:
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied embedding and LM head count once
    return sum(t.numel() * t.element_size() for t in unique.values())


@pytest.mark.parametrize("name, expert_parallel", [
    ("llama", False), ("qwen2", False), ("deepseek", False), ("deepseek", True), ("deepseek-fp8", False),
    ("deepseek-fp8", True)])
def test_each_rank_reads_only_its_slice_and_gets_the_same_weights(checkpoints, name, expert_parallel):
    path, dtype = checkpoints[name]
    whole_reader = CheckpointReader(path)
    whole = load_target(path, dtype, reader=whole_reader)
    per_rank = []
    for rank in range(2):
        reader = CheckpointReader(path)
        sliced = load_target(path, dtype, ShardSpec(rank, 2, expert_parallel), no_reduce, reader)
        # the old way: load everything, then cut (what a shard did before slice reading)
        reference = shard_target(load_target(path, dtype), rank, 2, no_reduce, expert_parallel)
        expected, got = reference.state_dict(), sliced.state_dict()
        assert sorted(got) == sorted(expected)
        if name == "qwen2":
            assert got["layers.0.self_attn.q_proj.bias"].shape[0] == whole.layers[0].self_attn.q_proj.bias.shape[0] // 2
        mismatched = [k for k in expected if not torch.equal(expected[k], got[k])]
        assert not mismatched, mismatched[:5]
        assert sliced.config == reference.config
        assert all(not t.is_meta for t in [*sliced.parameters(), *sliced.buffers()])
        if "fp8" not in name:  # stored dtype == compute dtype: the bytes read are exactly the bytes kept
            assert reader.bytes_read == stored_bytes(sliced)
        per_rank.append(reader.bytes_read)
    print(f"{name} EP={expert_parallel}: whole {whole_reader.bytes_read} B, per rank {per_rank}")
    assert max(per_rank) < whole_reader.bytes_read  # no rank reads the whole checkpoint
    assert sum(per_rank) >= whole_reader.bytes_read  # between them, the ranks read every tensor
    if "fp8" not in name:
        assert whole_reader.bytes_read == stored_bytes(whole)
    if name.startswith("deepseek"):  # past the replicated embedding and LM head, each rank reads little over half
        head = sum(stored_bytes(m) for m in (whole.embed_tokens, whole.lm_head))
        assert max(per_rank) - head < 0.6 * (whole_reader.bytes_read - head)


def test_checkpoint_errors_name_the_tensor(checkpoints, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = checkpoints["deepseek"]
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = "model.layers.1.mlp.experts.3.down_proj.weight"
    file = broken / index["weight_map"][victim]
    state = load_file(str(file))
    state[victim] = state[victim][:, :-1].contiguous()
    save_file(state, str(file))
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.experts\.3\.down_proj\.weight.*shape"):
        load_target(broken, "float32", ShardSpec(1, 2, True), no_reduce)
    del state[victim]
    save_file(state, str(file))
    with pytest.raises(ConfigError, match=r"missing tensors.*experts\.3\.down_proj"):
        load_target(broken, "float32", ShardSpec(0, 2, True), no_reduce)


def test_fp8_weights_kept_in_fp8_match_the_weights_dequantised_at_load(checkpoints):
    """``fp8_weights="matmul"`` (the GPU default): one byte per weight stays resident, and every matmul sees
    exactly the weight that dequantising at load gives, sharded or not."""
    path, dtype = checkpoints["deepseek-fp8"]
    for shard in (ShardSpec(), ShardSpec(1, 2), ShardSpec(0, 2, expert_parallel=True)):
        loaded = load_target(path, dtype, shard, no_reduce)
        kept = load_target(path, dtype, shard, no_reduce, fp8_weights="matmul").to(torch.float32)  # stays FP8
        fp8 = {name: m for name, m in kept.named_modules() if isinstance(m, FP8Linear)}
        assert len(fp8) > 20 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8.values())
        for name, module in fp8.items():
            expected = loaded.get_submodule(name).weight
            got = dequantize(module.weight, module.weight_scale_inv, module.block, expected.dtype, module.offset)
            assert torch.equal(got, expected), name
        resident = sum(m.weight.numel() * m.weight.element_size() for m in fp8.values())
        assert resident * 4 == sum(loaded.get_submodule(n).weight.numel() * 4 for n in fp8)  # 1 byte vs fp32's 4
    loaded, kept = load_target(path, dtype), load_target(path, dtype, fp8_weights="matmul")
    ids = torch.randint(0, loaded.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (loaded, kept):
        cache = model.make_cache(128, 16)
        for seq in range(2):
            cache.allocator.reserve(seq, 12)
        meta = cache.allocator.metadata([0, 1], [0, 0], [12, 12])
        logits.append(model(ids, torch.arange(12).expand(2, -1), cache, meta).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0)
