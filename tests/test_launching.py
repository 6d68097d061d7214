"""The distributed tests' launcher (tests/launching.py): a crash below Python runs once more, a Python error fails at
once, and a failure shows its cause before torchrun's summary."""

import os
import sys

import launching
import pytest


# torchrun prints this summary for a worker killed by a signal; the script below prints it itself.
SUMMARY = "  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 25346)  (SIGABRT)\n"
SCRIPT = """
import os, sys
marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    print("terminate called without an active exception")
    print({summary!r})
    sys.exit(1)
if sys.argv[2] == "python-error":
    raise RuntimeError("a bug in the script")
print("ok")
"""


def run(tmp_path, mode):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(summary=SUMMARY))
    cmd = [sys.executable, str(script), str(tmp_path / "crashed-once"), mode]
    return launching.launch(cmd, tmp_path / "console.log", cwd=str(tmp_path), env=dict(os.environ))


def test_a_crash_below_python_runs_once_more_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="crashed below Python, run again"):
        assert launching.finish(run(tmp_path, "ok")) == 0
    assert (tmp_path / "console.log").read_text().strip() == "ok"
    assert "terminate called" in (tmp_path / "console.log.crashed").read_text()


def test_a_python_error_after_the_rerun_fails_with_its_cause_first(tmp_path):
    with pytest.warns(UserWarning), pytest.raises(AssertionError) as failure:
        launching.finish(run(tmp_path, "python-error"))
    message = str(failure.value)
    assert message.startswith("causes:\nRuntimeError: a bug in the script"), message


def test_a_python_error_is_never_run_again(tmp_path):
    (tmp_path / "crashed-once").touch()
    with pytest.raises(AssertionError, match="a bug in the script"):
        launching.finish(run(tmp_path, "python-error"))
    assert not (tmp_path / "console.log.crashed").exists()


def test_the_failure_report_keeps_the_workers_lines_not_the_launchers():
    output = ("Fatal Python error: Aborted\n  File \"/x/fsdp_train.py\", line 12 in main\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + SUMMARY)
    report = launching.failure_report(output)
    assert report.splitlines()[1:3] == ["Fatal Python error: Aborted", '  File "/x/fsdp_train.py", line 12 in main']
    assert "ChildFailedError" not in report.split("--- last")[0]
    assert launching.crashed_below_python(output) and not launching.crashed_below_python("exitcode  : 1")
