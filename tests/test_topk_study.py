"""`benchmarks/topk.py` end to end on a tiny pair: the k table, its report files, and what the numbers must satisfy."""

from __future__ import annotations

import json

import pytest

from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer


@pytest.fixture
def pair(tmp_path):
    tokenizer = build_tiny_tokenizer()
    paths = {}
    for name, seed, layers in (("student", 0, 2), ("teacher", 1, 3)):
        path = tmp_path / name
        build_tiny_causal_lm(tokenizer, seed=seed, num_hidden_layers=layers).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(6)))
    math500 = tmp_path / "math500.jsonl"
    math500.write_text("".join(json.dumps({"problem": f"Find ${i}^2$.", "answer": str(i * i)}) + "\n" for i in range(6)))
    return paths, str(gsm8k), str(math500)


def test_topk_study_runs_and_resumes(pair, tmp_path):
    from benchmarks import topk

    paths, gsm8k, math500 = pair
    out = tmp_path / "report"
    argv = ["--teacher", paths["teacher"], "--student", paths["student"], "--gsm8k", gsm8k, "--math500", math500,
            "--problems", "2", "--batch_size", "2", "--max_new_tokens", "6", "--ks", "1", "8", "259", "--lora_r", "2",
            "--lora_alpha", "4", "--out", str(out)]  # fmt: skip
    report = topk.main(argv)
    rows = {(r["dataset"], r["beta"], r["k"]): r for r in report["rows"]}
    assert len(rows) == 2 * 2 * 3
    for dataset in ("gsm8k", "math500"):
        for beta in (0.0, 1.0):
            full = rows[(dataset, beta, 259)]
            # k = V is the full loss: share 1, no loss error, the same gradient and rock set.
            assert full["share_median"] == pytest.approx(1.0, abs=1e-4)
            assert full["loss_rel_error_max"] < 1e-4 and full["grad_cosine_min"] > 0.9999
            assert full["rock_jaccard_top50"] == 1.0
            assert rows[(dataset, beta, 1)]["share_median"] <= rows[(dataset, beta, 8)]["share_median"] + 1e-6
            assert rows[(dataset, beta, 1)]["wire_bytes_per_token"] < rows[(dataset, beta, 8)]["wire_bytes_per_token"]
    for name in ("topk.json", "topk.md", "topk.png"):
        assert (out / name).stat().st_size > 0
    # A rerun measures nothing again (the batches are on disk) and writes the same table.
    before = (out / "topk.md").read_text()
    (out / "batches" / "gsm8k_0.json").write_text((out / "batches" / "gsm8k_0.json").read_text())
    assert topk.main(argv)["rows"] == report["rows"]
    assert (out / "topk.md").read_text() == before
