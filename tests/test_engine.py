"""The shared rock-token engine on its own: the same loss and metrics as RockOPDTrainer, and metrics summed over
processes (the completions/* ones included) through the accelerator's gather."""

import copy
from collections import defaultdict

import pytest
import torch
from conftest import make_dataset

from hf_rockopd import RockOPDTrainer
from hf_rockopd.engine import RockTokenEngine, build_policy


def make_trainer(student, teacher, args, tokenizer):
    return RockOPDTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=make_dataset(), processing_class=tokenizer
    )


def dataset_batch(trainer, n=4):
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
    return {k: v for k, v in inputs.items() if torch.is_tensor(v)}


def most_common_completion_token(inputs):
    labels = inputs["labels"][:, 1:]
    return int(torch.bincount(labels[labels != -100]).argmax())


@pytest.mark.parametrize(
    "policy, normalization, probe_fraction",
    [
        ("uniform", "tokens", 0.0),
        ("rock_freeze", "tokens", 0.5),  # frozen rows, some of them probed: the fused path
        ("rock_freeze", "weights", 0.0),
        ("loss_quantile", "tokens", 0.0),  # weights decided from this step's divergences: the late path
    ],
)
def test_engine_without_a_trainer_matches_the_trainer(
    student, teacher, tokenizer, args_factory, policy, normalization, probe_fraction
):
    probe = make_trainer(student, teacher, args_factory(), tokenizer)
    inputs = dataset_batch(probe)
    kwargs = {"token_ids": [most_common_completion_token(inputs)]} if policy == "rock_freeze" else {}
    args = args_factory(
        rock_policy=policy,
        rock_policy_kwargs=kwargs,
        rock_normalization=normalization,
        rock_probe_fraction=probe_fraction,
        loss_chunk_size=7,
    )
    num_items = (inputs["labels"][:, 1:] != -100).sum() * 2  # as if a second micro-batch of the same size followed

    engine_student = copy.deepcopy(student)
    trainer = make_trainer(student, teacher, args, tokenizer)
    trainer.model.train()
    expected = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=num_items)
    expected.backward()

    engine = RockTokenEngine(args, build_policy(None, args), engine_student, teacher, tokenizer=tokenizer)
    engine_student.train()
    metrics = defaultdict(list)
    loss = engine.compute_loss(engine_student, inputs, step=0, training=True, num_items_in_batch=num_items, metrics=metrics)
    loss.backward()

    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-8)
    grads = dict(trainer.model.named_parameters())
    for name, param in engine_student.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    trainer_metrics = trainer._metrics["train"]
    assert set(metrics) == set(trainer_metrics) and "rock/frozen_fraction" in metrics
    for key, values in metrics.items():
        assert values == pytest.approx(trainer_metrics[key], rel=1e-6), key
    assert engine.policy.state_dict().keys() == trainer.rock_policy.state_dict().keys()


class SecondProcess:
    """Stands in for a 2-process accelerator: `gather` stacks this process's tensor with a fixed other process's."""

    num_processes = 2
    process_index = 0

    def __init__(self, other=None):
        self.other = other
        self.gathered = []

    def gather(self, tensor):
        self.gathered.append(tensor.detach().clone())
        other = self.other if self.other is not None else tensor
        return torch.cat([tensor, other.to(tensor)])

    def unwrap_model(self, model):
        return model


def test_completion_metrics_are_summed_over_processes(student, teacher, tokenizer, args_factory):
    args = args_factory()
    # The other process generated 3 completions of 10 tokens each (30), none with eos, beside 40 tokens in all.
    accelerator = SecondProcess(other=torch.tensor([[40.0, 3.0, 30.0, 3.0, 3.0]], dtype=torch.float64))
    engine = RockTokenEngine(args, build_policy(None, args), student, teacher, accelerator, tokenizer=tokenizer)
    # This process: two micro-batches, the first generated (2 completions: 3 tokens ending in eos 2, 1 token cut).
    generated = torch.tensor([[-100, 5, 6, 2], [-100, 7, -100, -100]])
    dataset = torch.tensor([[-100, -100, 9, 9]])
    metrics = defaultdict(list)
    total = engine.count_completions([generated, dataset], [True, False], eos_ids=2, device="cpu", metrics=metrics)

    (local,) = accelerator.gathered  # one gather for the count and the metrics
    assert local.tolist() == [[6.0, 2.0, 4.0, 1.0, 2.0]]
    assert total.dtype == torch.int64 and int(total) == 6 + 40
    assert metrics["completions/mean_length"] == [pytest.approx((4 + 30) / (2 + 3))]
    assert metrics["completions/clipped_ratio"] == [pytest.approx((1 + 3) / (2 + 3))]


def test_trainer_gathers_completion_metrics_and_the_token_count(student, teacher, tokenizer, args_factory):
    """One real process behind a stand-in that reports two identical ones: the trainer's completions/* metrics and
    its `num_items_in_batch` go through the gather, and the rock/* ones too."""
    trainer = make_trainer(student, teacher, args_factory(max_steps=1, max_new_tokens=9), tokenizer)
    accelerator = SecondProcess()
    trainer.rock_engine.accelerator = accelerator
    seen = {}
    original = trainer.compute_loss

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        seen["num_items"] = int(num_items_in_batch)
        seen["local"] = int((inputs["labels"][:, 1:] != -100).sum())
        seen["lengths"] = (inputs["labels"][:, 1:] != -100).sum(dim=1).float().mean().item()
        return original(model, inputs, return_outputs, num_items_in_batch)

    trainer.compute_loss = spy
    trainer.train()

    completion_gathers = [t for t in accelerator.gathered if t.shape == (1, 5)]
    rock_gathers = [t for t in accelerator.gathered if t.shape == (1, 13)]
    assert len(completion_gathers) == 1 and len(rock_gathers) == 1
    assert seen["num_items"] == 2 * seen["local"]  # both "processes" counted
    (log,) = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    assert log["completions/mean_length"] == pytest.approx(seen["lengths"])
    assert 0.0 <= log["completions/clipped_ratio"] <= 1.0
