"""The public prompt sets the repo carries in ``benchmarks/data/`` (one ``{"turns": [...]}`` per line).

They are what ``dspark bench``, ``dspark loadtest``, the benchmarks, the tests and the training
data's decontamination read; ``benchmarks/data/README.md`` gives their sources and licences.
A set is named (``"humaneval"``) or given as a path to any JSONL file of the same shape.
"""

from __future__ import annotations

from pathlib import Path

from dspark.jsonl import read_jsonl

PROMPT_SETS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
NAMES = ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "mt-bench", "swe-bench")


def prompt_set_path(name_or_path: str | Path) -> Path:
    """The file of a named set, or the path itself; a missing file is an error naming it."""
    path = PROMPT_SETS_DIR / f"{name_or_path}.jsonl" if str(name_or_path) in NAMES else Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt set {path} not found (named sets: {', '.join(NAMES)} in {PROMPT_SETS_DIR})")
    return path


def read_turns(name_or_path: str | Path) -> list[list[str]]:
    """Every row's turns."""
    path = prompt_set_path(name_or_path)
    rows = [row.get("turns") or [] for row in read_jsonl(path)]
    rows = [r for r in rows if r]
    if not rows:
        raise ValueError(f"{path}: no prompts (one {{\"turns\": [...]}} per line expected)")
    return rows


def read_prompts(name_or_path: str | Path, limit: int | None = None) -> list[str]:
    """The first turn of the first ``limit`` rows (all rows when None)."""
    return [turns[0] for turns in read_turns(name_or_path)[:limit]]


def round_robin(names: tuple[str, ...], count: int) -> list[str]:
    """``count`` first turns taken in turn from each named set (a mix of kinds of text)."""
    per_set = -(-count // len(names))
    lists = [read_prompts(name, per_set) for name in names]
    return [text for group in zip(*lists) for text in group][:count]
