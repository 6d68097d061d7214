"""The main job with the teacher outside its memory: `hf-rockopd teacher-cache --distill_config` makes the
held-out reference and its cache once, then `distill` trains against a served teacher and evaluates through the cache,
with no teacher model in the process; the refusals come before any model loads."""

from __future__ import annotations

import json

import pytest
import yaml
from served_teacher import server, teacher_dir  # noqa: F401 (fixtures)
from test_distill import write_problems

from hf_rockopd.commands.teacher_cache import TEACHER_CACHE_NAME, TeacherCacheArguments, teacher_cache
from hf_rockopd.commands.distill import parse_arguments
from hf_rockopd.distill import run as distill_run
from hf_rockopd.distill import run_distillation
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
from hf_rockopd.teachers import TeacherCache


@pytest.fixture
def job(tmp_path, teacher_dir):
    tokenizer = build_tiny_tokenizer()
    student = build_tiny_causal_lm(tokenizer, seed=0)
    student.save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    config = {
        "teacher": teacher_dir, "student": str(tmp_path / "student"), "dataset": write_problems(tmp_path / "p.jsonl"),
        "num_train_prompts": 4, "num_eval_problems": 3, "eval_max_new_tokens": 6, "eval_batch_size": 2,
        "output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 2, "max_new_tokens": 6,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "rock_policy": "uniform",
    }  # fmt: skip
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(config))
    return tmp_path, str(path)


def test_served_job_evaluates_through_the_cache_without_a_teacher_in_memory(job, server, monkeypatch):
    tmp_path, config = job
    run = tmp_path / "run"
    # Once, with the teacher loaded: the reference where distill reads it, and a cache of it.
    teacher_cache(TeacherCacheArguments(distill_config=config, top_k=16))
    assert (run / "teacher_reference.json").is_file() and (run / TEACHER_CACHE_NAME).is_file()
    # The server names its model "tiny-teacher": a cache under the local path's name is refused with it ...
    script, args, model_args = parse_arguments(["--config", config, "--teacher_server_url", server.url,
                                                "--teacher_top_k", "16", "--teacher_cache", str(run / TEACHER_CACHE_NAME)])  # fmt: skip
    with pytest.raises(ValueError, match="teacher: the cache has .*, asked for 'tiny-teacher'"):
        run_distillation(script, args, model_args)
    # ... and one scored by the server itself (the reference exists now) is read.
    served_cache = str(tmp_path / "served_cache.parquet")
    teacher_cache(TeacherCacheArguments(distill_config=config, top_k=16, teacher_server_url=server.url,
                                        out=served_cache))  # fmt: skip
    assert TeacherCache.read_settings(served_cache).teacher == "tiny-teacher"
    script, args, model_args = parse_arguments(["--config", config, "--teacher_server_url", server.url,
                                                "--teacher_top_k", "16", "--teacher_cache", served_cache])  # fmt: skip

    loaded = []
    real_resolve = distill_run.resolve_causal_lm
    monkeypatch.setattr(distill_run, "resolve_causal_lm", lambda name, **kw: loaded.append(name) or real_resolve(name, **kw))
    result = run_distillation(script, args, model_args)
    assert loaded == [script.student]  # the teacher never loaded here
    report = result.report
    for phase in ("before", "after"):
        evaluation = report["eval"][phase]
        assert evaluation["teacher_forced_divergence"] > 0 and evaluation["mean_divergence"] > 0
        assert evaluation["settings"]["teacher_forced_source"].startswith(f"cache {served_cache} (tiny-teacher) + server")
        assert "top-16" in evaluation["settings"]["teacher_source"]
    assert report["teacher"]["source"] == f"server {server.url}, cache {served_cache}"
    rocks = json.loads((run / "rock_tokens.json").read_text())
    assert rocks["teacher"]["top_k"] == 16
    # The teacher-forced divergence is the reference's, scored from the cache: the same before as a fresh
    # evaluation against the server gives (the cache holds what the server said).
    from hf_rockopd.evaluation.evaluate import evaluate_gsm8k
    from hf_rockopd.evaluation.teacher_reference import TeacherReference
    from hf_rockopd.models import packed_for_inference
    from hf_rockopd.teachers import ServedTeacher, TeacherClient
    from transformers import AutoModelForCausalLM

    problems = distill_run.load_distill_data(script, seed=args.seed).problems
    student = AutoModelForCausalLM.from_pretrained(script.student)
    # Packed as the run's evaluation packs it: oneDNN's packed products round differently from the plain ones by
    # about 1e-5 of this small divergence on some processors, which would hide what is compared here (the cache).
    with packed_for_inference(student):
        again = evaluate_gsm8k(
            student, build_tiny_tokenizer(), problems, teacher=ServedTeacher(TeacherClient(server.url), top_k=16),
            teacher_reference=TeacherReference.load(run / "teacher_reference.json"), max_new_tokens=6, batch_size=2,
            show_progress=False,
        )  # fmt: skip
    assert again.teacher_forced_divergence == pytest.approx(report["eval"]["before"]["teacher_forced_divergence"],
                                                            rel=1e-5)  # fmt: skip


def test_outside_teacher_refusals_come_before_any_model_loads(job, monkeypatch):
    tmp_path, config = job

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(distill_run, "resolve_causal_lm", refuse)
    script, args, model_args = parse_arguments(["--config", config, "--teacher_server_url", "http://127.0.0.1:1",
                                                "--teacher_top_k", "4"])  # fmt: skip
    with pytest.raises(ValueError, match=r"teacher_reference.json' is missing.*hf-rockopd teacher-cache"):
        run_distillation(script, args, model_args)
    script.student = None
    with pytest.raises(ValueError, match="pass --student"):
        run_distillation(script, args, model_args)
    with pytest.raises(ValueError, match="Give exactly one of --distill_config"):
        TeacherCacheArguments(top_k=4)
    with pytest.raises(ValueError, match="--reference needs --teacher"):
        TeacherCacheArguments(top_k=4, reference=config)
    assert not (tmp_path / "run").exists()


def test_served_example_config_is_the_main_job_with_the_teacher_served():
    """examples/configs/distill_qwen_served.yaml (`make distill-served`) is distill_qwen.yaml but for where the
    teacher lives and where the run goes; teacher-cache reads its held-out problems without the served fields."""
    from pathlib import Path

    configs = Path(__file__).resolve().parents[1] / "examples" / "configs"
    main = yaml.safe_load((configs / "distill_qwen.yaml").read_text())
    served = yaml.safe_load((configs / "distill_qwen_served.yaml").read_text())
    outside = {"teacher_server_url", "teacher_top_k", "teacher_cache"}
    assert set(served) - set(main) == outside and set(main) <= set(served)
    assert {k: v for k, v in served.items() if k not in outside | {"output_dir"}} == {
        k: v for k, v in main.items() if k != "output_dir"
    }
    assert served["teacher_cache"] == f"{served['output_dir']}/{TEACHER_CACHE_NAME}" and served["teacher_top_k"] == 64
    from hf_rockopd.commands.teacher_cache import _distill_settings

    script, args = _distill_settings(str(configs / "distill_qwen_served.yaml"))
    assert args.teacher_server_url is None and args.output_dir == served["output_dir"]
