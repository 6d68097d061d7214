"""Every notebook in examples/notebooks runs top to bottom on tiny models, offline, so none can rot.

Each notebook starts with a cell tagged `parameters` (papermill's convention) that names the real models. The test
inserts a cell right after it (as papermill does) that switches to tiny models built in code and points every output
into a temporary directory, executes the notebook with nbclient in a python3 kernel of this interpreter, and reads the
notebook's `summary` dict back through one appended cell that prints it as JSON.
"""

import json
import math
import os
import sys

import pytest


nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "examples", "notebooks")
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")
SUMMARY_MARKER = "NOTEBOOK-SUMMARY:"
KERNEL = "python3"


def _ensure_kernel() -> None:
    """Make sure a `python3` kernelspec exists; a fresh venv without one gets it installed into its own prefix.

    jupyter_client launches a kernelspec whose argv starts with `python` with `sys.executable`, so the kernel runs this
    interpreter (and sees this venv's hf_rockopd).
    """
    from jupyter_client.kernelspec import KernelSpecManager

    if KERNEL not in KernelSpecManager().find_kernel_specs():
        from ipykernel.kernelspec import install

        install(user=False, prefix=sys.prefix)
    assert KERNEL in KernelSpecManager().find_kernel_specs(), "no python3 kernelspec after installing one"


def _prompts_file(tmp_path) -> str:
    """GSM8K's training split where this machine has it; otherwise a few GSM8K-shaped problems written here."""
    if os.path.isfile(GSM8K):
        return os.path.abspath(GSM8K)
    path = tmp_path / "gsm8k.jsonl"
    # Varied wording, so the generations (and the rock-token statistics over them) see many token types, as GSM8K's
    # do: one repeated template left too few types for the analysis notebook's top-k.
    names = ["Tom", "Maria", "Aiko", "Liam", "Priya", "Omar", "Greta", "Chen"]
    templates = [
        ("{n} has {a} apples and buys {b} more. How many apples does {n} have now?", lambda a, b: a + b),
        ("A baker makes {a} loaves each hour for {b} hours. How many loaves is that?", lambda a, b: a * b),
        ("{n} reads {a} pages on Monday and {b} pages on Tuesday. How many pages in total?", lambda a, b: a + b),
        ("A train travels {a} miles per hour. How far does it go in {b} hours?", lambda a, b: a * b),
        ("{n} had {a} dollars and spent {b} dollars on lunch. How much money is left?", lambda a, b: a - b),
        ("Each box holds {b} pencils. How many boxes are needed for {a} pencils, if every box is full?",
         lambda a, b: a // b),
        ("There are {a} students and {b} of them walk to school. How many do not walk?", lambda a, b: a - b),
        ("{n} plants {b} rows of {a} tulips in the garden. How many tulips were planted?", lambda a, b: a * b),
    ]
    rows = []
    for i in range(64):
        template, solve = templates[i % len(templates)]
        b = 2 + i % 5
        a = b * (3 + i)
        rows.append({"question": template.format(n=names[i % len(names)], a=a, b=b), "answer": f"#### {solve(a, b)}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_notebook(name: str, tmp_path, monkeypatch, **overrides) -> tuple[dict, object]:
    """Execute `name` with `overrides` injected after its parameters cell; return (summary, executed notebook)."""
    _ensure_kernel()
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert tagged == [1], f"{name}: the second cell (and only it) must be tagged 'parameters', got cells {tagged}"
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name} is stored with outputs"
    params = {"USE_TINY_MODELS": True, "OUTPUT_DIR": str(tmp_path / "out"), **overrides}
    injected = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nb.cells.insert(2, nbformat.v4.new_code_cell(injected, metadata={"tags": ["injected-parameters"]}))
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import json, sys\nprint({SUMMARY_MARKER!r} + json.dumps({{'summary': summary, 'prefix': sys.prefix}}))"
    ))
    for key in params:  # an override of a name the notebook does not define would silently test nothing
        assert f"\n{key} = " in "\n" + nb.cells[1].source, f"{name}'s parameters cell has no {key}"
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=240, resources={"metadata": {"path": str(tmp_path)}}
    )
    # Offline, headless; one OpenMP thread: tiny models gain nothing from two, and on a busy 2-core machine two
    # spinning threads made a 4-step tiny run cost 6 times the CPU time (11.4 s against 1.7 s).
    for key, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    client.execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
    line = next(line for line in text.splitlines() if line.startswith(SUMMARY_MARKER))
    result = json.loads(line[len(SUMMARY_MARKER):])
    assert result["prefix"] == sys.prefix, f"the kernel ran the Python of {result['prefix']}, not {sys.prefix}"
    return result["summary"], nb


def test_quickstart_lora(tmp_path, monkeypatch):
    summary, _ = run_notebook(
        "01_quickstart_lora.ipynb", tmp_path, monkeypatch, DATA_PATH=_prompts_file(tmp_path), NUM_PROMPTS=16,
        MAX_STEPS=4, BATCH_SIZE=4, MAX_NEW_TOKENS=16, LEARNING_RATE=5e-3,
        ROCK_POLICY_KWARGS={"warmup_steps": 1, "refresh_every": 1, "persistence": 2, "top_k": 10},
    )
    assert summary["steps"] == 4
    assert len(summary["losses"]) == 4 and summary["all_losses_finite"]
    assert all(x >= 0 for x in summary["losses"])
    assert 1 <= len(summary["rock_token_ids"]) <= 10
    assert summary["final_set_size"] == len(summary["rock_token_ids"])
    assert 0 < summary["final_frozen_fraction"] <= 1
    for key in ("rock/frozen_fraction", "rock/divergence_mass_share", "rock/set_size", "rock/mean_divergence_other"):
        assert key in summary["rock_metric_columns"]
    # r = 16 on every linear layer of the 2-layer student (H = 64, I = 128, k/v width 32): 16 * 1024 per layer.
    assert summary["lora_parameters"] == 2 * 16 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 2 + (128 + 64))
    assert "adapter_model.safetensors" in summary["adapter_files"]
    assert os.path.isfile(tmp_path / "out" / "rock_tokens.json")
    # The same run through RockDistillationTrainer (a dataset of prompts, TRL's DistillationTrainer underneath).
    assert summary["distillation_steps"] == 4
    losses = summary["distillation_losses"]
    assert len(losses) == 4 and all(math.isfinite(x) and x >= 0 for x in losses)
    assert {"rock/frozen_fraction", "rock/set_size"} <= set(summary["distillation_rock_metric_columns"])
    assert summary["distillation_lora_parameters"] == summary["lora_parameters"]  # the same student, the same adapter
    assert summary["distillation_rock_tokens_written"]


def test_rock_token_analysis(tmp_path, monkeypatch):
    top_k, ks, steps = 5, [3, 5], 2
    summary, _ = run_notebook(
        "02_rock_token_analysis.ipynb", tmp_path, monkeypatch, DATA_PATH=_prompts_file(tmp_path), NUM_PROMPTS=8,
        MAX_NEW_TOKENS=16, BATCH_SIZE=8, TOP_K=top_k, STABILITY_KS=ks, TRAIN_STEPS=steps, LEARNING_RATE=1e-3,
        ROCK_POLICY_KWARGS={"warmup_steps": 1, "refresh_every": 1, "persistence": 1, "top_k": top_k},
    )
    counts = {int(k): v for k, v in summary["rock_counts"].items()}
    scores = {int(k): v for k, v in summary["rock_scores"].items()}
    rocks = summary["rock_ids"]
    assert sum(counts.values()) == summary["tokens"] > 0
    # The paper's rule, checked from the notebook's own table: rocks are seen >= 2 times, are not among the 5 most
    # frequent types, and out-score every other eligible type.
    assert len(rocks) == top_k == len(set(rocks))
    most_frequent = set(sorted(counts, key=lambda i: (-counts[i], i))[:5])
    assert all(counts[i] >= 2 and i not in most_frequent for i in rocks)
    others = [scores[i] for i in counts if counts[i] >= 2 and i not in most_frequent and i not in rocks]
    assert min(scores[i] for i in rocks) >= max(others, default=0.0)
    assert math.isclose(summary["rock_token_share"], sum(counts[i] for i in rocks) / summary["tokens"])
    assert 0 < summary["divergence_coverage"] <= 1
    # Stability: one row per (sub-corpus size, K), Jaccard in [0, 1].
    sizes = {row["subcorpus_size"] for row in summary["stability_rows"]}
    assert len(summary["stability_rows"]) == len(sizes) * len(ks)
    for row in summary["stability_rows"]:
        assert 0 <= row["jaccard_min"] <= row["jaccard_mean"] <= row["jaccard_max"] <= 1
    # Controls: as many as the rocks, none of them a rock.
    assert len(summary["controls"]) == top_k and not set(summary["controls"]) & set(rocks)
    geometry = {row["group"]: row for row in summary["geometry"]}
    assert set(geometry) == {"rock", "rare_high_divergence", "random_matched"}
    assert geometry["rock"]["occurrences"] == sum(counts[i] for i in rocks)
    # The trainer's side: its rock_tokens.json after the run, and the rock/ metrics of every step.
    assert summary["trainer_step"] == steps and len(summary["losses"]) == steps
    assert all(math.isfinite(x) for x in summary["losses"])
    assert 0 <= summary["lab_trainer_jaccard"] <= 1
    # Probed frozen positions keep the rocks measured once frozen.
    assert {"rock/frozen_fraction", "rock/set_size", "rock/mean_divergence_rock", "rock/divergence_mass_share"} <= set(
        summary["rock_metric_columns"]
    )
    assert [row["group"] for row in summary["comparison"]] == ["rock", "rare_high_divergence", "random_matched"]
    assert summary["figures"] == ["frequency_vs_divergence.png", "rock_metrics.png", "stability.png"]
    for name in summary["figures"]:
        with open(tmp_path / "out" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_single_gpu_qlora(tmp_path, monkeypatch):
    summary, _ = run_notebook(
        "03_single_gpu_qlora.ipynb", tmp_path, monkeypatch, DATA_PATH=_prompts_file(tmp_path), NUM_PROMPTS=8,
        TRAIN_OVERRIDES={"max_steps": 2, "max_new_tokens": 16, "max_length": 1024, "loss_chunk_size": 16,
                         "learning_rate": 5e-3},
    )
    # Parameter counts of the recipe pair from their config shapes; the model cards give 1.7B (1.4B non-embedding)
    # and 8.2B (6.95B non-embedding).
    assert round(summary["student_parameters"] / 1e9, 1) == 1.7
    assert round(summary["student_non_embedding"] / 1e9, 1) == 1.4
    assert round(summary["teacher_parameters"] / 1e9, 1) == 8.2
    assert round(summary["teacher_non_embedding"] / 1e9, 2) == 6.95
    rows = summary["recipe_rows"]
    assert rows["teacher weights (bf16)"] == 2 * summary["teacher_parameters"]
    # NF4 costs a bit over half a byte per quantized weight (absmax and code books included), bf16 for the rest.
    quantized = summary["student_non_embedding"]
    nf4 = rows["student weights (NF4 + bf16 rest)"] - 2 * (summary["student_parameters"] - quantized)
    assert 0.5 * quantized < nf4 < 0.52 * quantized
    # The loss paths' measured bytes per (row, vocab) entry: at least float32 logits and log-probabilities of both
    # heads (16 bytes). B = 4, T = 256 + 512 = 768, chunk = 512: full logits have B·T/chunk = 6 times the rows.
    c = summary["bytes_per_entry"]
    assert 16 <= c["chunked"] <= 64 and 16 <= c["full"] <= 64
    assert summary["seq_len"] == 768
    full, chunked = rows["loss path, full (B, T, V) logits"], rows["loss path, RockOPDTrainer (chunked)"]
    assert math.isclose(full / chunked, 6 * c["full"] / c["chunked"])
    assert summary["fits"] == {"chunked": True, "full": False}
    assert summary["chunked_gib"] < 24 < summary["full_gib"]
    assert summary["largest_batch"]["chunked"] > summary["largest_batch"]["full"] >= 1
    # The formulas agree to the byte with a tiny student really loaded in NF4, and with the LoRA parameter count.
    for name, row in summary["check"].items():
        assert row["predicted"] == row["measured"], name
    assert summary["lora_trainable"] == summary["lora_predicted"] > 0
    assert summary["quantized_layers"] > 0 and summary["lora_b_changed"]
    assert summary["steps"] == 2 and all(math.isfinite(x) for x in summary["losses"])
