"""Launching the two-process runs of the distributed tests (`torchrun`, `accelerate launch`, or one plain process).

Every launch writes its whole console output to a log file beside its outputs. A failed launch fails the test with the
lines that say why first (`terminate called`, `what():`, Python errors), then the end of the log: torchrun's failure
summary alone names a signal, not its cause.

A worker killed by SIGABRT or SIGSEGV is a crash below Python: gloo's TCP transport ends the process with
`std::terminate` when a socket call fails (one such crash: pytorch/gloo#514). CI once lost a whole run to one (rank 1
of an FSDP2 launch, SIGABRT, nothing printed but torchrun's summary) that 40 launches of the same fixtures did not
repeat. Such a launch is run once more, with a warning that CI prints and the crashed log kept beside the new one;
the test's exact comparisons still judge its outputs. A Python error (exit code 1) is never retried.
"""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from dataclasses import dataclass, field


# torchrun's failure summary: "exitcode  : -6 (pid: 123)  (SIGABRT)"; accelerate launch prints the same summary.
_SIGNAL_DEATH = re.compile(r"exitcode\s*:\s*-(6|11)\b")
_CAUSE = re.compile(r"terminate called|what\(\)|Fatal Python error|Error:|Exception:|Aborted|Segmentation fault|"
                    r'^\s*File ".*", line \d+ in ')  # the fault handler's stack lines (a traceback's have ", in")


@dataclass
class Launch:
    """One started command, its log file, and whether it must succeed."""

    cmd: list[str]
    log: str
    cwd: str
    env: dict[str, str]
    expect_ok: bool = True
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> Launch:
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        with open(self.log, "w") as handle:
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=handle,
                                         stderr=subprocess.STDOUT, text=True)
        return self

    def output(self) -> str:
        with open(self.log, errors="replace") as handle:
            return handle.read()


def launch(cmd: list[str], log: str | os.PathLike, *, cwd: str, env: dict[str, str], expect_ok: bool = True) -> Launch:
    """Start `cmd` with its output going to `log`; `finish` waits for it. Python's fault handler is on in every
    process: a crash below Python prints each thread's Python stack, which says where it happened."""
    return Launch(list(cmd), os.fspath(log), cwd, dict(env, PYTHONFAULTHANDLER="1"), expect_ok).start()


def failure_report(output: str, tail: int = 3000) -> str:
    """The lines of `output` that say why a launch failed, then its last `tail` characters."""
    causes = [line for line in output.splitlines() if _CAUSE.search(line)]
    # The launcher's own traceback (ChildFailedError) repeats in every failure: keep the workers' lines first.
    causes = [line for line in causes if "ChildFailedError" not in line][:20]
    return "causes:\n" + "\n".join(causes) + f"\n--- last {tail} characters ---\n" + output[-tail:]


def crashed_below_python(output: str) -> bool:
    """Whether a worker of the launch died of SIGABRT or SIGSEGV (not a Python error)."""
    return bool(_SIGNAL_DEATH.search(output))


def finish(started: Launch, timeout: float = 1800) -> int:
    """Wait for a launch; one that must succeed and crashed below Python runs once more; any other failure fails
    the test with `failure_report`. Returns the exit code."""
    started.proc.wait(timeout=timeout)
    code = started.proc.returncode
    if code != 0 and started.expect_ok and crashed_below_python(output := started.output()):
        warnings.warn(f"{' '.join(started.cmd[-6:])}: a worker crashed below Python, run again.\n"
                      + failure_report(output, tail=1500), stacklevel=2)
        os.replace(started.log, started.log + ".crashed")
        started.start().proc.wait(timeout=timeout)
        code = started.proc.returncode
    if started.expect_ok:
        assert code == 0, failure_report(started.output())
    return code
