"""Every JSONL reader splits rows at ``\\n`` only: U+2028, U+2029, U+0085 and form feeds are valid unescaped inside
JSON strings (issue 44: a public chat set with one U+2028 crashed benchmarks.peers); a bad row names its file and
line."""

from __future__ import annotations

import json

import pytest

from benchmarks.learning_curve import read_curve
from dspark.evaluation.prompt_sets import read_prompts, read_turns
from dspark.training.corpus import banned_spans
from dspark.training.dataset import decontaminate, read_prompts_file, read_rows

ODD = "line\u2028separator\u2029paragraph\x0cfeed\x85next"


def _write(path, rows, bad_row: bool = False):
    text = "".join(json.dumps(r, ensure_ascii=False).replace("\\f", "\x0c") + "\n" for r in rows)
    assert "\u2028" in text and "\x0c" in text  # written raw, not escaped
    path.write_text(text + ("{not json\n" if bad_row else ""), encoding="utf-8")
    return path


def test_every_reader_keeps_rows_with_unicode_line_breaks_whole(tmp_path):
    turns = [{"turns": [f"{ODD} {i}"]} for i in range(3)]
    assert read_turns(_write(tmp_path / "set.jsonl", turns)) == [[f"{ODD} {i}"] for i in range(3)]
    assert read_prompts(tmp_path / "set.jsonl", 2) == [f"{ODD} 0", f"{ODD} 1"]
    assert read_prompts_file(_write(tmp_path / "prompts.jsonl", [{"prompt": ODD}])) == [ODD]
    assert read_rows(_write(tmp_path / "rows.jsonl", [{"prompt": ODD, "response_ids": [1]}]))[0]["prompt"] == ODD
    assert read_curve(_write(tmp_path / "curve.jsonl", [{"step": 1, "note": ODD}])) == [{"step": 1, "note": ODD}]
    bench = tmp_path / "bench"
    bench.mkdir()
    words = " ".join(f"w{i}" for i in range(14))
    _write(bench / "b.jsonl", [{"turns": [f"{ODD} {words}"]}])
    assert decontaminate([words, "something else entirely"], bench) == ["something else entirely"]
    assert tuple(f"w{i}" for i in range(13)) in banned_spans(bench)


@pytest.mark.parametrize("reader", [read_turns, read_prompts_file, read_curve])
def test_a_malformed_row_is_an_error_naming_the_file_and_line(tmp_path, reader):
    path = _write(tmp_path / "broken.jsonl", [{"turns": [ODD], "prompt": ODD}], bad_row=True)
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 2 is not valid JSON"):
        reader(path)
