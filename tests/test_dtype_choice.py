"""``dtype: auto``: bf16 where the CPU has native bf16 matrix instructions, fp32 elsewhere, said with a reason."""

from __future__ import annotations

import pytest
import torch

from dspark.builder import build_engine
from dspark.dtype_choice import choose_dtype, cpu_flags, resolve_dtype
from dspark.schema import EngineFileConfig, load_engine_config

from conftest import REPO

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("cpuinfo, dtype, named", [
    (SAPPHIRE_RAPIDS, "bfloat16", "avx512_bf16"),
    (GRAVITON3, "bfloat16", "bf16"),
    (EPYC_AVX2, "float32", "no native bf16"),
    ("", "float32", "no native bf16"),  # flags unknown (no /proc/cpuinfo): the safe choice
])
def test_auto_chooses_by_the_cpus_bf16_instructions(cpuinfo, dtype, named):
    choice = choose_dtype(on_gpu=False, flags=cpu_flags(cpuinfo))
    assert choice.dtype == dtype and named in choice.reason


def test_auto_is_bf16_on_gpus_and_explicit_dtypes_are_kept():
    assert choose_dtype(on_gpu=True, flags=cpu_flags(EPYC_AVX2)).dtype == "bfloat16"
    assert resolve_dtype("float32", flags=cpu_flags(SAPPHIRE_RAPIDS)).dtype == "float32"
    assert resolve_dtype("bfloat16", flags=cpu_flags(EPYC_AVX2)).reason == "configured"


def test_embedded_default_resolves_both_parts_for_the_cpu_it_is_on():
    cfg = load_engine_config(REPO / "configs" / "embedded.yaml")
    assert cfg.target.dtype == cfg.draft.dtype == "auto"
    for cpuinfo, expected in ((SAPPHIRE_RAPIDS, "bfloat16"), (EPYC_AVX2, "float32")):
        concrete, choices = cfg.with_concrete_dtypes(flags=cpu_flags(cpuinfo))
        assert concrete.target.dtype == concrete.draft.dtype == expected
        assert {c.dtype for c in choices.values()} == {expected}


def test_engine_reports_the_dtype_it_chose(tiny_target_dir, tiny_draft_dir):
    cfg = EngineFileConfig(target={"path": str(tiny_target_dir)}, draft={"path": str(tiny_draft_dir)},
                           engine={"kv_cache_tokens": 1024, "max_num_seqs": 2, "scheduler": "full"})
    engine = build_engine(cfg, backend="native")
    expected = choose_dtype().dtype  # this machine's answer
    assert engine.dtypes["target"]["dtype"] == engine.dtypes["draft"]["dtype"] == expected
    assert engine.config.dtype == expected and "auto" in engine.dtypes["target"]["reason"]
    assert engine.drafter.model.fc.weight.dtype == getattr(torch, expected)
