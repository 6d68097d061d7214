"""`examples/reports/real_budget/seed_runs.py` puts the committed records where the long run and the verdict read
them; the verdict on them gives the committed `uniform` figures again (87 of 250 against the base's 78), and the
card renders from them."""

import json
import os

import pytest
from conftest import REAL_BUDGET_REPORT as REPORT
from conftest import real_budget_script

from hf_rockopd.cli import main as cli_main


def _seed():
    real_budget_script("seed_runs").main()


def test_the_seeded_runs_give_the_committed_uniform_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _seed()
    shared, uniform = tmp_path / "runs/qwen-long/shared", tmp_path / "runs/qwen-long/uniform"
    base = json.loads((shared / "eval_before.cache.json").read_text())
    step0 = json.loads((shared / "checkpoint_eval_step0.json").read_text())
    first = json.loads(open(os.path.join(REPORT, "uniform", "checkpoint_evals.jsonl")).readline())
    assert step0 == {"key": {**base["settings"]["cache_key"], "head": 32}, "row": first}
    before = json.loads((uniform / "eval_before.json").read_text())
    assert [r["correct"] for r in before["records"]] == [r["correct"] for r in base["records"]]
    assert sum(r["correct"] for r in before["records"]) == 78

    assert cli_main(["verdict", "--runs", str(uniform), "--out", str(tmp_path / "result.json")]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["num_eval_problems"] == 250 and result["steps"] == 200
    run = result["runs"]["uniform"]
    assert (run["accuracy_before"], run["accuracy_after"]) == (0.312, 0.348)
    assert run["p_value_vs_before"] == pytest.approx(0.3135, abs=1e-4)  # 36 gained, 27 lost
    # Its card renders from the seeded folder (the adapter's weights are not committed) and carries the verdict.
    assert cli_main(["card", str(uniform), "--out", str(tmp_path / "card" / "uniform.md")]) == 0
    card = (tmp_path / "card" / "uniform.md").read_text()
    assert "| this student | 0.348 [0.292, 0.409] | 0.1099 |" in card
    assert "**Not significantly better than its base.**" in card and "`uniform` ended training with no rock" in card

    # Run again, nothing is overwritten.
    mtimes = {p: p.stat().st_mtime_ns for p in shared.iterdir()}
    _seed()
    assert {p: p.stat().st_mtime_ns for p in shared.iterdir()} == mtimes
    assert "kept runs/qwen-long/shared/teacher_reference.json (already there)" in capsys.readouterr().out
