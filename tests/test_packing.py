"""oneDNN-packed linears for frozen weights (the packed CPU decode, benchmarks/decode.py): same outputs and greedy
tokens, a LoRA student trains as the dense one, nothing held twice."""

from __future__ import annotations

import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_rockopd.models import (
    PACKING_ENV,
    PackedLinear,
    build_tiny_causal_lm,
    can_pack,
    pack_for_inference,
    pack_frozen_linears,
    packed_for_inference,
    unpack_linears,
)


pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _model(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return build_tiny_causal_lm(**kwargs).eval()


def test_packed_logits_and_greedy_tokens_equal_the_dense_model():
    dense, packed = _model(), _model()
    count = pack_for_inference(packed)
    layers = dense.config.num_hidden_layers
    assert count == 7 * layers  # q, k, v, o, gate, up, down per layer; lm_head stays dense
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == count
    ids = torch.randint(3, dense.config.vocab_size, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)
        kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(packed.generate(ids, **kwargs), dense.generate(ids, **kwargs))


def test_bias_and_lm_head_skip():
    linear = torch.nn.Linear(5, 7)
    x = torch.randn(2, 3, 5)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x).detach(), atol=1e-6, rtol=1e-6)
    model = _model()
    pack_for_inference(model)
    assert type(model.lm_head) is torch.nn.Linear  # the engine projects teacher rows with lm_head.weight itself


def test_packing_freezes_and_a_packed_layer_passes_its_input_gradient():
    model = _model()
    pack_for_inference(model)
    assert not any(p.requires_grad for p in model.parameters())
    linear = torch.nn.Linear(6, 5).requires_grad_(False)
    x = torch.randn(2, 3, 6, requires_grad=True)
    grad = torch.randn(2, 3, 5)
    (expected,) = torch.autograd.grad(linear(x), x, grad)
    packed = PackedLinear(linear)
    (got,) = torch.autograd.grad(packed(x), x, grad)
    # The backward is the dense product itself (the weight read back exactly), so it equals autograd's bit for bit.
    assert torch.equal(got, expected)
    assert packed.packed_weight.grad is None and not list(packed.parameters())


def _lora(seed: int = 0):
    model = get_peft_model(_model(seed), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # non-zero adapters, so the base layers' input gradients reach every lora_A
            torch.nn.init.normal_(parameter, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_a_lora_student_with_packed_base_layers_trains_as_the_dense_one():
    dense, packed = _lora(), _lora()
    layers = dense.base_model.model.config.num_hidden_layers
    assert pack_frozen_linears(packed) == 7 * layers  # every base layer; lm_head (the loss reads it) and adapters not
    assert type(packed.base_model.model.lm_head) is torch.nn.Linear
    assert {n for n, p in packed.named_parameters() if p.requires_grad} == {
        n for n, p in dense.named_parameters() if p.requires_grad
    }
    ids = torch.randint(3, 100, (2, 9))
    for model in (dense, packed):
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.loss = loss.item()
    assert packed.loss == pytest.approx(dense.loss, rel=1e-5)
    trained = dict(dense.named_parameters())
    for name, parameter in packed.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(parameter, trained[name], atol=1e-5, rtol=1e-5)
    # Unpacked, the base layers are the dense ones exactly, and the model is a plain peft model again.
    assert unpack_linears(packed) == 7 * layers
    base = dict(dense.named_parameters())
    for name, parameter in packed.named_parameters():
        if "base_layer" in name:
            assert torch.equal(parameter, base[name]) and not parameter.requires_grad


def test_packed_for_inference_gives_the_model_back_trainable():
    model = _model()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.lm_head.weight.requires_grad_(False)
    ids = torch.randint(3, 100, (2, 5))
    with torch.no_grad():
        dense = model(ids).logits
    with packed_for_inference(model) as count, torch.no_grad():
        assert count == 7 * model.config.num_hidden_layers + 1  # the head too: nothing reads its weight here
        torch.testing.assert_close(model(ids).logits, dense, atol=1e-5, rtol=1e-5)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {
        n: n != "lm_head.weight" for n in reference
    }
    assert all(torch.equal(p, reference[n]) for n, p in model.named_parameters())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page release reads /proc/self/maps (Linux)")
def test_packing_a_memory_mapped_model_releases_its_dense_pages(tmp_path):
    """The dense weights' file pages leave the process as each is packed: a packed model does not hold the model
    twice at its peak (+1.7 GB on the Qwen teacher before this)."""

    def file_rss() -> int:
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(status["RssFile"].split()[0]) * 1024

    _model(hidden_size=512, num_hidden_layers=4).save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 100, (1, 6))
    with torch.no_grad():
        dense = model(ids).logits  # every weight read: its pages are resident
    packed_bytes = sum(
        m.weight.numel() * 4 for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"
    )
    before = file_rss()
    pack_for_inference(model)
    released = before - file_rss()
    assert released > 0.8 * packed_bytes, (released, packed_bytes)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense, atol=1e-5, rtol=1e-5)


def test_packed_weights_replace_the_dense_ones():
    model = _model()
    before = {name for name, _ in model.named_parameters()}
    pack_for_inference(model)
    after = {name for name, _ in model.named_parameters()}
    gone = before - after
    assert gone and all(name.endswith("proj.weight") for name in gone)
    assert not any(name.startswith("lm_head") or "embed" in name for name in gone)


def test_subclasses_tied_weights_and_other_dtypes_are_left_alone(monkeypatch):
    lora = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).eval()
    ids = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        dense = lora(ids).logits
    packed = pack_for_inference(lora)
    layers = lora.base_model.model.config.num_hidden_layers
    # q_proj is a LoRA layer: its base layer is packed, its adapters (whose `.weight` peft reads) are not.
    assert packed == 7 * layers
    q_proj = lora.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear" and isinstance(q_proj.base_layer, PackedLinear)  # peft's layer, kept
    assert type(q_proj.lora_A["default"]) is torch.nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(lora(ids).logits, dense, atol=1e-5, rtol=1e-5)

    tied = _model()
    tied.lm_head = torch.nn.Linear(tied.config.hidden_size, tied.config.vocab_size, bias=False)
    extra = torch.nn.Linear(tied.config.hidden_size, tied.config.vocab_size, bias=False)
    extra.weight = tied.lm_head.weight
    tied.extra = extra
    pack_for_inference(tied)
    assert type(tied.extra) is torch.nn.Linear

    assert not can_pack(_model().bfloat16())
    monkeypatch.setenv(PACKING_ENV, "0")
    model = _model()
    assert pack_for_inference(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
