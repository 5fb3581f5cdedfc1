"""JSON Lines, read as the format defines them: one JSON value per ``\\n``-terminated line.

``str.splitlines()`` also splits at U+2028, U+2029, U+0085, form feeds and other characters that JSON allows
unescaped inside strings (real chat data has them), so a row holding one would be cut in two; every reader of a
JSONL file in this project goes through :func:`parse_jsonl` instead. A row that is not JSON is an error naming the
file and the line. Control characters left unescaped inside strings (a raw form feed or tab) are read as
they are, as most JSON writers in the wild let them through.
"""

from __future__ import annotations

import json
from pathlib import Path


def parse_jsonl(text: str, where: str | Path) -> list:
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line, strict=False))  # control characters inside strings too
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: line {number} is not valid JSON ({err.msg} at column {err.colno})") \
                    from None
    return rows


def read_jsonl(path: str | Path) -> list:
    """The rows of the JSONL file ``path``."""
    return parse_jsonl(Path(path).read_text(encoding="utf-8"), path)
