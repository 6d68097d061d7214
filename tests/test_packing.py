"""oneDNN-packed linears for inference-only models (issue 29): same outputs and greedy tokens, nothing held twice,
and no silent gradient."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_rockopd.models import PACKING_ENV, PackedLinear, build_tiny_causal_lm, can_pack, pack_for_inference


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


def test_packing_freezes_and_refuses_a_gradient():
    model = _model()
    pack_for_inference(model)
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(RuntimeError, match="do not pack a model you train"):
        PackedLinear(torch.nn.Linear(4, 4))(torch.randn(2, 4, requires_grad=True))


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
    # q_proj is a LoRA layer, which reads its base layer's and adapters' `.weight`: left whole; the other six
    # projections are packed.
    assert packed == 6 * layers
    assert type(lora.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "Linear"  # peft's, kept
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
