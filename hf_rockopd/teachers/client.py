"""`TeacherClient`: the trainer's side of a served teacher (vLLM, or `hf-rockopd serve-teacher`), over HTTP.

TRL's `VLLMClient.get_sequence_logprobs` speaks the same format, but constructing it requires vLLM to be installed in
the training process and its requests have no timeout or API key; this client needs only `requests`, bounds every
request (timeout, a few retries with exponential backoff) and turns every failure into an error naming the URL.

Example:
```python
>>> from hf_rockopd.teachers import TeacherClient
>>> client = TeacherClient("http://127.0.0.1:8000", timeout=5.0, max_retries=2)
>>> client.url
'http://127.0.0.1:8000'
```
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import requests
import torch
from transformers.utils import logging

from .protocol import MalformedTeacherResponse, completions_request, parse_prompt_logprobs


logger = logging.get_logger(__name__)

__all__ = ["API_KEY_ENV", "TeacherClient", "TeacherServerError"]

API_KEY_ENV = "HF_ROCKOPD_TEACHER_API_KEY"

START_HINT = (
    "Start the teacher first: on a GPU `vllm serve TEACHER --max-logprobs K` (vLLM's own server); on a CPU "
    "`hf-rockopd serve-teacher --model TEACHER --port PORT`."
)


class TeacherServerError(RuntimeError):
    """A served teacher could not be used: unreachable after the retries, an HTTP error, or a malformed answer."""


class TeacherClient:
    """Scores token sequences on a served teacher: the top-k log-probabilities of every position.

    Args:
        url (`str`): the server's base URL (`http://host:port`, without `/v1`).
        api_key (`str`, *optional*): sent as `Authorization: Bearer <key>`; defaults to `$HF_ROCKOPD_TEACHER_API_KEY`.
        timeout (`float`, *optional*, defaults to `60.0`): seconds to wait for one answer.
        max_retries (`int`, *optional*, defaults to `3`): further tries after a connection error, a timeout or a 5xx
            answer; a 4xx answer (a refused request) is not retried.
        backoff (`float`, *optional*, defaults to `1.0`): seconds before the first retry, doubled at each next one.

    Example: see the module docstring.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 1.0,
    ):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout, self.max_retries, self.backoff = float(timeout), int(max_retries), float(backoff)
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        self._model: str | None = None

    # -------------------------------------------------------------------------------------------- transport ----
    def _request(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        """The JSON answer of one request, retried on transient failures; `TeacherServerError` otherwise."""
        url = f"{self.url}{path}"
        last: str = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self._session.request(method, url, timeout=self.timeout, **kwargs)
            except requests.Timeout:
                last = f"no answer within {self.timeout:g} s"
                continue
            except requests.ConnectionError as err:
                last = f"cannot connect ({type(err).__name__})"
                continue
            if response.status_code >= 500:
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code != 200:
                raise TeacherServerError(f"The teacher at {url} refused {what}: HTTP {response.status_code}: "
                                         f"{response.text[:500]}")  # fmt: skip
            try:
                return response.json()
            except ValueError as err:
                raise TeacherServerError(f"The teacher at {url} answered {what} with something not JSON: "
                                         f"{response.text[:200]!r}.") from err  # fmt: skip
        tries = self.max_retries + 1
        raise TeacherServerError(f"The teacher at {url} did not answer {what} after {tries} tries: {last}. {START_HINT}")

    def health(self) -> None:
        """`TeacherServerError` unless `/health` answers."""
        url = f"{self.url}/health"
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                if self._session.get(url, timeout=self.timeout).status_code == 200:
                    return
            except requests.RequestException:
                pass
        raise TeacherServerError(f"No teacher server answers at {self.url} ({url}). {START_HINT}")

    @property
    def model(self) -> str:
        """The served model's name, from `/v1/models` (the first one listed, as vLLM serves one)."""
        if self._model is None:
            answer = self._request("GET", "/v1/models", "the model list")
            try:
                self._model = str(answer["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as err:
                raise TeacherServerError(f"The teacher at {self.url}/v1/models lists no model: {answer!r}.") from err
        return self._model

    # ------------------------------------------------------------------------------------------------ scoring ----
    def sequence_logprobs(
        self, sequences: Sequence[Sequence[int]], top_k: int, vocab_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, `(ids, log_probs)` of shape `(len(sequence), top_k + 1)` (see
        `protocol.parse_prompt_logprobs`): row `i` is the teacher's distribution of token `i`.

        One request for all sequences. A malformed answer is a `TeacherServerError` naming the sequence and the
        position; ids outside `[0, vocab_size)` are malformed.
        """
        if not sequences:
            return []
        body = completions_request(sequences, top_k, self.model)
        answer = self._request("POST", "/v1/completions", f"a scoring request ({len(sequences)} sequences)", json=body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != len(sequences):
            got = len(choices) if isinstance(choices, list) else type(choices).__name__
            raise TeacherServerError(
                f"The teacher at {self.url} answered {got} choices for {len(sequences)} sequences."
            )
        # vLLM answers in prompt order, each choice with its `index`; sort by it in case a server does not.
        choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        out = []
        for i, (choice, sequence) in enumerate(zip(choices, sequences)):
            try:
                out.append(parse_prompt_logprobs(choice.get("prompt_logprobs"), sequence, top_k, vocab_size))
            except (MalformedTeacherResponse, AttributeError) as err:
                raise TeacherServerError(f"The teacher at {self.url} answered sequence {i} malformed: {err}") from err
        return out
