"""The peers table over several runs (``benchmarks.peers --runs``): ratios stay within a run."""

import json

from benchmarks.peers import add_run, combine, table


def _rows(system: str, tok_s: float, base_tok_s: float) -> list[dict]:
    rows = []
    for name, value in (("vLLM plain", base_tok_s), (system, tok_s)):
        for mode in ("batch 1", "concurrency 8"):
            rows.append({"system": name, "mode": mode, "temperature": "greedy", "tok_s": value,
                         "vs_vllm_plain": value / base_tok_s, "tau": None, "greedy_equal_to_vllm_plain": 3})
    return rows


def _report(date: str, cpu: str, rows: list[dict], max_tokens: int = 256, served=None) -> dict:
    return {"date": date, "machine": cpu, "dtype": "float32", "sets": ["humaneval"], "per_set": 3, "prompts": 3,
            "max_tokens": max_tokens, "engine_cpus": None, "served_engine_cpus": None, "rows": rows,
            "served_vllm": served}


def test_each_system_keeps_its_own_runs_baseline(tmp_path):
    runs_file = tmp_path / "runs.json"
    add_run(runs_file, _report("d1", "cpu A", _rows("ngram", 40.0, 20.0)))
    add_run(runs_file, _report("d2", "cpu B", _rows("native", 15.0, 30.0), max_tokens=64))  # other settings
    runs = add_run(runs_file, _report("d3", "cpu B", _rows("native", 12.0, 24.0)))
    assert len(json.loads(runs_file.read_text())["runs"]) == 3

    report = combine(runs)
    by = {(r["system"], r["mode"]): r for r in report["rows"]}
    assert by[("ngram", "batch 1")]["run"] == 1 and by[("ngram", "batch 1")]["vs_vllm_plain"] == 2.0
    assert by[("native", "batch 1")]["run"] == 3 and by[("native", "batch 1")]["vs_vllm_plain"] == 0.5
    assert by[("vLLM plain", "batch 1")]["run"] == 3  # the latest run's baseline row; run 2 has other settings
    assert set(report["runs"]) == {1, 3}
    markdown = table(report)
    assert "| ngram | 1 | batch 1 | greedy | 40.0 | 20.0 | 2.00x |" in markdown
    assert "| native | 3 | batch 1 | greedy | 12.0 | 24.0 | 0.50x |" in markdown
    assert "run 1: d1, cpu A" in markdown and "run 2" not in markdown
