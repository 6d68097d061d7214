"""A real `hf-rockopd serve-teacher` on loopback for the tests: a subprocess on a free port, serving a tiny model saved
to a folder (the same weights as the in-process teacher it is compared with)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]


def save_tiny_teacher(path: str | os.PathLike, seed: int = 1, head_scale: float = 1.0) -> str:
    """A tiny teacher (the conftest `teacher`'s weights at seed 1) and its tokenizer saved to `path`; `head_scale`
    multiplies its output head (a peaked teacher)."""
    from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tokenizer, seed=seed, num_hidden_layers=3)
    model.lm_head.weight.data *= head_scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TeacherServer:
    """`hf-rockopd serve-teacher --model MODEL_DIR` on `port`; `start()` waits for `/health`, `kill()` is SIGKILL."""

    def __init__(self, model_dir: str | os.PathLike, port: int | None = None, api_key: str | None = None, **limits):
        self.model_dir, self.port, self.api_key = str(model_dir), port or free_port(), api_key
        self.limits = limits
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> TeacherServer:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        if self.api_key:
            env["HF_ROCKOPD_TEACHER_API_KEY"] = self.api_key
        flags = [f"--{name}={value}" for name, value in self.limits.items()]
        cmd = [sys.executable, "-m", "hf_rockopd.cli", "serve-teacher", "--model", self.model_dir,
               "--served_model_name", "tiny-teacher", "--port", str(self.port), *flags]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve-teacher exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if requests.get(f"{self.url}/health", headers=headers, timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"serve-teacher did not answer /health within {timeout} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None


VOCAB = 259  # the tiny tokenizer's


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """The tiny teacher saved once per test module."""
    return save_tiny_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def server(teacher_dir):
    """`hf-rockopd serve-teacher` on the tiny teacher, allowed the whole vocabulary as its top-k."""
    served = TeacherServer(teacher_dir, max_top_k=VOCAB).start()
    yield served
    served.kill()
