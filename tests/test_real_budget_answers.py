"""`examples/reports/real_budget/answers.py` reads the committed validation answers: its counts are the records'
own, and bad arguments are refused with the expected form."""

import json
import os

import pytest
from conftest import REAL_BUDGET_REPORT as REPORT
from conftest import real_budget_script


def _module():
    return real_budget_script("answers")


def test_counts_are_the_records_own(tmp_path, capsys):
    before = os.path.join(REPORT, "validation_lr1e-4", "eval_before.json")
    after = os.path.join(REPORT, "validation_lr1e-4_t256", "eval_after.json")
    out = _module().main(["--before", before, "--after", f"t256={after}", "--examples", "1",
                          "--json", str(tmp_path / "answers.json")])
    records = {name: json.load(open(path))["records"] for name, path in (("before", before), ("after", after))}
    pairs = enumerate(zip(records["before"], records["after"]))
    gained = [i for i, (b, a) in pairs if a["correct"] and not b["correct"]]
    run = out["runs"]["t256"]
    assert run["gained_indices"] == gained and run["correct"] == sum(r["correct"] for r in records["after"])
    assert out["problems"] == 64 and json.loads((tmp_path / "answers.json").read_text()) == out
    assert out["style"]["base student"]["\\boxed{...}"] == pytest.approx(
        sum("\\boxed{" in r["completion"] for r in records["before"]) / 64)
    printed = capsys.readouterr().out
    assert f"-- problem {gained[0]} (gained" in printed and "word for word the same" in printed


def test_bad_arguments_are_refused(capsys):
    before = os.path.join(REPORT, "validation_lr1e-4", "eval_before.json")
    with pytest.raises(SystemExit):
        _module().main(["--before", before, "--after", "no_equals_sign"])
    assert "--after takes NAME=PATH, got 'no_equals_sign'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _module().main(["--before", before, "--after", f"a={before}", "--teacher", "ref.json"])
    assert "--teacher needs --tokenizer" in capsys.readouterr().err
