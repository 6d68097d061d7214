"""`RockDistillationTrainer` against TRL's own `DistillationTrainer`: the same loss and gradients with uniform weights,
tool-result tokens never weighted, and our side of vLLM generation (with a stand-in for TRL's `VLLMGeneration`: vLLM
cannot be installed on these CPU machines, so no real vLLM runs here)."""

import copy

import pytest
import torch
from trainer_kinds import KINDS, distillation_batch
from trl import DistillationConfig, DistillationTrainer

from hf_rockopd import RockDistillationTrainer
from hf_rockopd.policies import TokenPolicy
from hf_rockopd.trainers import RockLossOutput
from hf_rockopd.trainers.distillation import VLLM_INSTALL


KIND = KINDS["distillation"]


def trl_trainer(student, teacher, tokenizer, tmp_path, **overrides):
    """TRL's DistillationTrainer with the settings `KIND.args` gives ours (minus the rock fields)."""
    args = KIND.args(tmp_path / "trl", **overrides).to_dict()
    fields = DistillationConfig.__dataclass_fields__
    args = DistillationConfig(**{k: v for k, v in args.items() if k in fields and fields[k].init})
    return DistillationTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=KIND.dataset(), processing_class=tokenizer
    )


def loss_and_grads(trainer, inputs, training=True):
    trainer.model.train(training)
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    if training:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def with_head_transforms(model, softcap=None, logits_scaling=None):
    config = model.config.get_text_config()
    config.final_logit_softcapping = softcap
    config.logits_scaling = logits_scaling
    return model


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tool_mask", [False, True], ids=["no_tools", "tool_mask"])
def test_uniform_loss_and_gradients_equal_distillation_trainers(student, teacher, tokenizer, tmp_path, beta, tool_mask):
    settings = dict(beta=beta, rock_policy="uniform", loss_chunk_size=5)
    ours = KIND.make(copy.deepcopy(student), teacher, KIND.args(tmp_path / "ours", **settings), tokenizer)
    theirs = trl_trainer(copy.deepcopy(student), teacher, tokenizer, tmp_path, **settings)
    inputs = distillation_batch(tokenizer, range(4), tool_mask=tool_mask)
    if tool_mask:
        assert 0 < int(inputs["num_items_in_batch"]) < int(inputs["completion_mask"].sum())
    for training in (True, False):  # training: the generation batch's count; eval: the micro-batch's mean
        loss, grads = loss_and_grads(ours, inputs, training)
        reference, reference_grads = loss_and_grads(theirs, inputs, training)
        torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-7)
        assert grads.keys() == reference_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert ours._metrics["train"]["entropy"] == pytest.approx(theirs._metrics["train"]["entropy"], rel=1e-5)


@pytest.mark.parametrize(
    "softcap, logits_scaling, temperature",
    [(3.0, None, 1.0), (None, 4.0, 1.0), (3.0, 0.5, 0.7)],
    ids=["softcap", "logits_scaling", "both_at_temperature_0.7"],
)
def test_uniform_equality_holds_for_transformed_heads_and_temperature(
    tokenizer, tmp_path, softcap, logits_scaling, temperature
):
    from hf_rockopd.models import build_tiny_causal_lm

    student = with_head_transforms(build_tiny_causal_lm(tokenizer, seed=0), softcap, logits_scaling)
    teacher = with_head_transforms(build_tiny_causal_lm(tokenizer, seed=1, num_hidden_layers=3), softcap, logits_scaling)
    settings = dict(beta=0.5, rock_policy="uniform", temperature=temperature)
    ours = KIND.make(copy.deepcopy(student), teacher, KIND.args(tmp_path / "ours", **settings), tokenizer)
    assert ours.args.loss_temperature == temperature  # DistillationTrainer scores at its sampling temperature
    theirs = trl_trainer(copy.deepcopy(student), teacher, tokenizer, tmp_path, **settings)
    inputs = distillation_batch(tokenizer, range(4), tool_mask=True)
    loss, grads = loss_and_grads(ours, inputs)
    reference, reference_grads = loss_and_grads(theirs, inputs)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)


class EveryPosition(TokenPolicy):
    """Weights every position 1, mask or not, and records the masks it was shown."""

    name = "every_position_test"

    def __init__(self):
        super().__init__()
        self.masks = []

    def weights(self, batch):
        self.masks.append(batch.mask.clone())
        return torch.ones(batch.mask.shape)


def test_tool_result_tokens_are_never_weighted(student, teacher, tokenizer, tmp_path):
    policy = EveryPosition()
    trainer = KIND.make(student, teacher, KIND.args(tmp_path / "out"), tokenizer, rock_policy=policy)
    inputs = distillation_batch(tokenizer, range(4), tool_mask=True)
    loss, outputs = trainer.compute_loss(trainer.model, inputs, return_outputs=True)
    assert isinstance(outputs, RockLossOutput) and outputs.loss is loss
    tool = inputs["tool_mask"] == 0
    expected_mask = inputs["completion_mask"].bool() & ~tool
    assert torch.equal(policy.masks[-1], expected_mask)  # the policy never sees a tool token as a loss position
    assert torch.equal(outputs.mask, expected_mask)
    assert (outputs.weights[tool] == 0).all() and (outputs.weights[expected_mask] == 1).all()
    assert (outputs.divergence[tool] == 0).all() and (outputs.divergence[expected_mask] > 0).all()


# -------------------------------------------------------------------------------------------------- vLLM ----
def test_use_vllm_without_vllm_names_the_install_command_before_any_model_loads(tmp_path):
    args = KIND.args(tmp_path / "out", use_vllm=True)
    with pytest.raises(ImportError) as err:
        RockDistillationTrainer(model="/nonexistent/student", teacher_model="/nonexistent/teacher", args=args)
    assert VLLM_INSTALL in str(err.value)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_under_fsdp2_is_refused_before_any_model_loads(tmp_path, monkeypatch, mode):
    from hf_rockopd.trainers import distillation as ours

    monkeypatch.setattr(ours, "is_vllm_available", lambda: True)  # as where vLLM is installed
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    args = KIND.args(tmp_path / "out", use_vllm=True, vllm_mode=mode)
    with pytest.raises(ValueError, match=f"not been run with vLLM generation \\(vllm_mode='{mode}'\\) under FSDP2"):
        RockDistillationTrainer(model="/nonexistent/student", teacher_model="/nonexistent/teacher", args=args)


class StandInVLLM:
    """Stands in for TRL's `VLLMGeneration`: records its settings and returns fixed completions per prompt."""

    instances = []

    def __init__(self, completions, **settings):
        self.completions, self.settings = completions, settings
        self.synced, self.prompts = 0, []
        StandInVLLM.instances.append(self)

    def sync_weights(self):
        self.synced += 1

    def generate(self, prompts, images, num_generations, profiler):
        assert num_generations == 1
        self.prompts.append([list(p) for p in prompts])
        completion_ids = [list(self.completions[i % len(self.completions)]) for i in range(len(prompts))]
        return prompts, completion_ids, None, None


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_completions_are_exactly_what_the_loss_sees(student, teacher, tokenizer, tmp_path, monkeypatch, mode):
    import trl.trainer.distillation_trainer as trl_distillation

    import hf_rockopd.trainers.distillation as ours

    eos = tokenizer.eos_token_id
    completions = [[65, 66, 67, eos], [68, 69, 70, 71, 72, 73], [74, eos]]  # ended, clipped, short
    StandInVLLM.instances.clear()
    monkeypatch.setattr(ours, "is_vllm_available", lambda: True)
    monkeypatch.setattr(trl_distillation, "is_vllm_available", lambda: True)
    monkeypatch.setattr(trl_distillation, "VLLMGeneration", lambda **kw: StandInVLLM(completions, **kw))

    freeze = 67  # the rock token: its position gets weight 0
    args = KIND.args(
        tmp_path / "out",
        use_vllm=True,
        vllm_mode=mode,
        max_steps=1,
        rock_policy="rock_freeze",
        rock_policy_kwargs={"token_ids": [freeze]},
    )
    trainer = KIND.make(student, teacher, args, tokenizer)
    (vllm,) = StandInVLLM.instances
    assert vllm.settings["mode"] == mode and vllm.settings["max_completion_length"] == args.max_completion_length

    seen = []
    original = trainer.compute_loss

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = original(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        seen.append((inputs, outputs))
        return (loss, outputs) if return_outputs else loss

    trainer.compute_loss = spy
    trainer.train()
    assert vllm.synced == 1 and len(vllm.prompts) == 1 and len(vllm.prompts[0]) == 4
    (inputs, outputs), = seen
    rows = []
    for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"]):
        rows.append(ids[mask.bool()].tolist())
    assert sorted(rows) == sorted(completions[i % 3] for i in range(4))
    assert int(inputs["num_items_in_batch"]) == sum(len(completions[i % 3]) for i in range(4))
    valid = inputs["completion_mask"].bool()
    assert torch.equal(outputs.mask, valid)
    assert torch.equal(outputs.weights[valid] == 0, inputs["completion_ids"][valid] == freeze)
    # The prompts the stand-in received are the chat-templated prompts the loss's backbones see (left-padded there).
    sent = sorted(map(tuple, vllm.prompts[0]))
    received = sorted(tuple(p[m.bool()].tolist()) for p, m in zip(inputs["prompt_ids"], inputs["prompt_mask"]))
    assert sent == received
