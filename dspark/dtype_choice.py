"""``dtype: auto``: the compute dtype that is fastest where the model runs, and why it was chosen.

On a GPU, bf16. On a CPU, bf16 only where the CPU has native bf16 matrix instructions
(x86: AVX-512 BF16 or AMX-BF16; Arm: the BF16 extension); without them PyTorch emulates
bf16 matmuls through fp32 conversions, which measured 1.3-2.3x slower than plain fp32 on a
2-core AVX2 EPYC (issue 18), so fp32 is the fast dtype there. The choice is made once, in the
process that builds the model (the in-process engine, or the serving replica, which is packed
on the node of its actors), and reported by ``/health``, ``dspark bench`` and the logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo: x86 flags, Arm "Features"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU feature flags of this machine (``cpuinfo``: the text of /proc/cpuinfo, for tests)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="ignore") if path.is_file() else ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # the concrete dtype: "bfloat16" or "float32"
    reason: str  # one line for /health, bench reports and logs

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "reason": self.reason}


def choose_dtype(on_gpu: bool = False, flags: set[str] | None = None) -> DtypeChoice:
    """What ``auto`` means on this machine (``flags``: the CPU's feature flags; default: read them)."""
    if on_gpu:
        return DtypeChoice("bfloat16", "auto: bf16 on a GPU")
    flags = cpu_flags() if flags is None else flags
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return DtypeChoice("bfloat16", f"auto: the CPU has native bf16 matrix instructions ({', '.join(native)})")
    return DtypeChoice("float32", "auto: the CPU has no native bf16 (none of "
                                  f"{', '.join(NATIVE_BF16_FLAGS)}); bf16 would be emulated, fp32 is faster")


def resolve_dtype(dtype: str, on_gpu: bool = False, flags: set[str] | None = None) -> DtypeChoice:
    """A configured dtype made concrete: ``auto`` is chosen for this machine, any other is kept."""
    if dtype == "auto":
        return choose_dtype(on_gpu, flags)
    return DtypeChoice(dtype, "configured")
