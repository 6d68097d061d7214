"""A teacher outside the trainer: the wire format both ways, a real `hf-rockopd serve-teacher` on loopback, both
trainers against it (equal to the in-process teacher at k = V), the config's refusals and the server's faults."""

from __future__ import annotations

import json
import math

import pytest
import requests
import torch
from served_teacher import VOCAB, TeacherServer, free_port, server, teacher_dir  # noqa: F401 (fixtures)

from hf_rockopd.teachers import ModelTopKTeacher, TeacherClient, TeacherServerError
from hf_rockopd.teachers.protocol import MalformedTeacherResponse, parse_prompt_logprobs



# One choice of a vLLM `/v1/completions` answer with `prompt_logprobs=2`, in the documented schema (vLLM's
# `CompletionResponseChoice.prompt_logprobs: list[dict[int, Logprob] | None]`, serialized with string keys): null at
# position 0; at position 2 the sequence's own token (7) is outside the top 2 and comes third with its rank.
VLLM_CHOICE = json.loads("""
{"index": 0, "text": "x", "logprobs": null, "finish_reason": "length", "stop_reason": null,
 "prompt_logprobs": [null,
   {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}, "9": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}},
   {"3": {"logprob": -0.2, "rank": 1, "decoded_token": "c"}, "4": {"logprob": -2.0, "rank": 2, "decoded_token": "d"},
    "7": {"logprob": -6.25, "rank": 41, "decoded_token": "e"}}]}
""")


def test_client_reads_vllm_prompt_logprobs_schema():
    ids, lp = parse_prompt_logprobs(VLLM_CHOICE["prompt_logprobs"], [1, 5, 7], top_k=2, vocab_size=VOCAB)
    assert ids.tolist() == [[-1, -1, -1], [5, 9, -1], [3, 4, 7]]
    torch.testing.assert_close(lp[2], torch.tensor([-0.2, -2.0, -6.25]))
    assert math.isinf(lp[1, 2]) and lp[0].isneginf().all()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p[:-1], "list of 3 positions"),
        (lambda p: p[:2] + [None], "position 2"),
        (lambda p: p[:2] + [{"3": {"logprob": float("nan"), "rank": 1}}], "NaN"),
        (lambda p: p[:2] + [{"999": {"logprob": -0.1, "rank": 1}}], "outside the student's vocabulary"),
        (lambda p: p[:2] + [{"3": {"logprob": -0.1}, "4": {"logprob": -0.2}}], "sum past 1"),
        (lambda p: p[:2] + [{str(i): {"logprob": -9.0, "rank": i + 1} for i in range(4)}], r"more than top_k \+ 1"),
    ],
)
def test_malformed_answers_are_refused(mutate, message):
    with pytest.raises(MalformedTeacherResponse, match=message):
        parse_prompt_logprobs(mutate(list(VLLM_CHOICE["prompt_logprobs"])), [1, 5, 7], top_k=2, vocab_size=VOCAB)


# ------------------------------------------------------------------------------------------------ real server ----


def test_server_answers_what_an_in_process_top_k_computes(server, teacher_dir):
    from transformers import AutoModelForCausalLM

    sequence = [10, 72, 105, 33, 258, 40, 41]
    (ids, lp), = TeacherClient(server.url).sequence_logprobs([sequence], top_k=4, vocab_size=VOCAB)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    expected = ModelTopKTeacher(teacher, top_k=4).targets(torch.tensor([sequence]), torch.ones(1, 7, dtype=torch.long),
                                                          step=0)[0]  # fmt: skip
    assert torch.equal(ids, expected[:, 0].long())
    torch.testing.assert_close(lp, expected[:, 1], rtol=1e-5, atol=1e-5)


def test_trl_vllm_client_reads_our_server(server):
    """TRL's own client (`VLLMClient.get_sequence_logprobs`) reads our answers unchanged. Its constructor needs vLLM
    installed, which a CPU machine has not, so the instance is built without it; the method is TRL's."""
    from trl.generation.vllm_client import VLLMClient

    client = object.__new__(VLLMClient)
    client.session, client.base_url, client.model = requests.Session(), server.url, "tiny-teacher"
    sequence = [10, 72, 105, 33, 258, 40]
    out = client.get_sequence_logprobs([sequence], prompt_lengths=[2], top_logprobs=3)
    (ids, lp), = TeacherClient(server.url).sequence_logprobs([sequence], top_k=3, vocab_size=VOCAB)
    assert out["logprob_token_ids"][0] == ids[2:, :3].tolist()
    torch.testing.assert_close(torch.tensor(out["logprobs"][0]), lp[2:, :3])
    own = [lp[i][ids[i] == sequence[i]] for i in range(2, len(sequence))]
    assert out["actual_logprobs"][0] == [[float(v[0])] for v in own]


def test_limits_are_answered_with_400(server):
    too_many = requests.post(f"{server.url}/v1/completions", json={"prompt": [[1, 2]], "prompt_logprobs": VOCAB + 1})
    assert too_many.status_code == 400 and "limit" in too_many.json()["error"]["message"]
    text = requests.post(f"{server.url}/v1/completions", json={"prompt": "hello", "prompt_logprobs": 1})
    assert text.status_code == 400 and "token ids" in text.json()["error"]["message"]
    wrong_model = requests.post(f"{server.url}/v1/completions", json={"model": "x", "prompt": [1, 2], "prompt_logprobs": 1})
    assert wrong_model.status_code == 404
    assert requests.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny-teacher"


def test_api_key_is_checked_on_every_request(teacher_dir):
    served = TeacherServer(teacher_dir, api_key="sesame").start()
    try:
        assert requests.get(f"{served.url}/v1/models").status_code == 401
        assert requests.get(f"{served.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        with pytest.raises(TeacherServerError, match="401"):
            TeacherClient(served.url, api_key="nope", max_retries=0).sequence_logprobs([[1, 2]], 1, VOCAB)
        (ids, _), = TeacherClient(served.url, api_key="sesame").sequence_logprobs([[1, 2]], 1, VOCAB)
        assert ids.shape == (2, 2)
    finally:
        served.kill()


def test_unreachable_server_is_an_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TeacherServerError, match=f"{url}.*serve-teacher"):
        TeacherClient(url, timeout=1, max_retries=1, backoff=0.01).health()
