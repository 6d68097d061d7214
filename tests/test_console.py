"""What a run prints: library notices filtered only around our own calls, real warnings still shown, compact lines."""

import io
import logging
import os
import subprocess
import sys
import warnings

from hf_rockopd.console import PhaseLog, compact_step_line, quiet_library_imports, quiet_training


GC_NOTICE = "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing`"
DEEPSPEED_NOTICE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
BNB_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'."


def caught_warnings(emit, scope=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if scope is None:
            emit()
        else:
            with scope():
                emit()
    return [(w.category.__name__, str(w.message)) for w in caught]


def test_training_scope_filters_its_notices_only_inside_and_only_those():
    def emit():
        warnings.warn(GC_NOTICE, FutureWarning)
        warnings.warn("`foo` is deprecated, use `bar`", FutureWarning)  # not ours to silence
        warnings.warn("the loss is NaN", UserWarning)

    inside = caught_warnings(emit, quiet_training)
    assert inside == [("FutureWarning", "`foo` is deprecated, use `bar`"), ("UserWarning", "the loss is NaN")]
    assert ("FutureWarning", GC_NOTICE) in caught_warnings(emit)  # outside the scope it shows again


def test_generate_notice_is_dropped_inside_the_training_scope_only(caplog):
    logger = logging.getLogger("transformers.generation.utils")
    notice = "Passing `generation_config` together with generation-related arguments=({'x'}) is deprecated"
    with caplog.at_level(logging.WARNING, logger="transformers.generation.utils"):
        with quiet_training():
            logger.warning(notice)
            logger.warning("Setting `pad_token_id` to `eos_token_id`")
        logger.warning(notice)
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["Setting `pad_token_id` to `eos_token_id`", notice]
    assert not logger.filters


def test_deepspeed_cpu_notice_is_dropped_inside_the_training_scope_only():
    """accelerate imports DeepSpeed (when installed) while a trainer is built; on a machine without a GPU it logs
    that it chose the CPU. Its logger does not propagate, so a handler of its own records what gets through."""
    logger, seen = logging.getLogger("DeepSpeed"), []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        with quiet_training():
            logger.warning(DEEPSPEED_NOTICE)
            logger.warning("Setting accelerator to CUDA")  # another DeepSpeed message still shows
        logger.warning(DEEPSPEED_NOTICE)
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in seen] == ["Setting accelerator to CUDA", DEEPSPEED_NOTICE]
    assert not logger.filters


def test_import_scope_filters_trl_experimental_and_the_bitsandbytes_kernel_notice(caplog):
    from trl.import_utils import TRLExperimentalWarning

    def emit():
        warnings.warn("You are importing from 'trl.experimental'.", TRLExperimentalWarning)
        warnings.warn("a real import-time problem", UserWarning)

    assert caught_warnings(emit, quiet_library_imports) == [("UserWarning", "a real import-time problem")]
    assert ("TRLExperimentalWarning", "You are importing from 'trl.experimental'.") in caught_warnings(emit)

    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        with quiet_library_imports():
            bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module")
            bnb.warning("CUDA kernel missing")  # another bitsandbytes message still shows
        bnb.warning(BNB_NOTICE)
    assert [record.getMessage() for record in caplog.records] == ["CUDA kernel missing", BNB_NOTICE]
    assert not bnb.filters


def test_importing_the_package_is_quiet_and_leaves_global_filters_alone():
    """A fresh interpreter: `import hf_rockopd` prints neither notice, changes no global filter, and a real warning
    raised afterwards (even one of TRL's experimental category) still shows."""
    code = (
        "import logging, warnings\n"
        "before = list(warnings.filters)\n"
        "import hf_rockopd\n"
        "assert warnings.filters == before, 'global warning filters changed'\n"
        "assert not logging.getLogger('bitsandbytes.backends.cpu.ops').filters\n"
        "from trl.import_utils import TRLExperimentalWarning\n"
        "warnings.warn('a real warning', UserWarning)\n"
        "warnings.warn('experimental elsewhere', TRLExperimentalWarning)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRL_EXPERIMENTAL_SILENCE"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "a real warning" in done.stderr and "experimental elsewhere" in done.stderr
    assert "You are importing from 'trl.experimental'" not in done.stderr
    assert "gemm_4bit_forward" not in done.stderr


def test_compact_step_line_and_phase_log():
    logs = {"loss": 0.55738, "grad_norm": 2.6, "rock/frozen_fraction": 0.16015625, "completions/clipped_ratio": 1.0}
    assert compact_step_line(logs, 10, 20, 24.61) == "step 10/20  loss 0.5574  frozen 16.0%  clipped 100%  24.6 s/step"
    assert compact_step_line({"loss": 1.0}, 1, 2, None) == "step 1/2  loss 1.0000"
    assert compact_step_line({"train_runtime": 3.0, "train_loss": 0.5}, 2, 2, 1.0) is None

    stream, now = io.StringIO(), [0.0]
    phases = PhaseLog(stream=stream, clock=lambda: now[0])
    phases("loading teacher", "HuggingFaceTB/SmolLM2-135M-Instruct")
    now[0] = 3725.0
    phases("saving")
    assert stream.getvalue().splitlines() == [
        "[0:00] loading teacher: HuggingFaceTB/SmolLM2-135M-Instruct",
        "[1:02:05] saving",
    ]
