"""Tests of `hf_rockopd.policies`: the registry, every built-in policy, their statistics and their saved state."""

import copy
import io
import json
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_rockopd import policies
from hf_rockopd.policies import (
    EntropyPolicy,
    LossQuantilePolicy,
    RandomMatchedPolicy,
    RockFreezePolicy,
    RockOnlinePolicy,
    TokenBatch,
    TokenPolicy,
    TokenStatistics,
    UniformPolicy,
    available_policies,
    check_policy_kwargs,
    get_policy,
    parse_policy_kwargs,
    register_policy,
)
from hf_rockopd.policies.rock_set import save_rock_set


BUILTINS = ["entropy", "loss_quantile", "random_matched", "rock_freeze", "rock_online", "uniform"]


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def make_batch(ids, mask=None, step=0, div=None, scored=None, entropy=None, training=True):
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() == 1:
        t = t[None]
    m = torch.ones_like(t, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool).view_as(t)
    d = None if div is None else torch.as_tensor(div, dtype=torch.float32).view_as(t)
    s = None
    if d is not None or entropy is not None:
        s = m.clone() if scored is None else torch.as_tensor(scored, dtype=torch.bool).view_as(t)
    e = None if entropy is None else torch.as_tensor(entropy, dtype=torch.float32).view_as(t)
    return TokenBatch(t, m, step, divergence=d, scored=s, student_entropy=e, training=training)


def occ(token_id, n, div):
    """`n` occurrences of `token_id`, each with divergence `div`."""
    return [(token_id, div)] * n


def online_step(policy, step, pairs, training=True, unscored=()):
    """One optimizer step as the trainer drives it: `weights()` on the labels, then `update()` with divergences.

    Positions whose id is in `unscored` are not measured (as frozen rocks the trainer does not project).
    """
    ids = [i for i, _ in pairs]
    divs = [0.0 if i in unscored else d for i, d in pairs]
    scored = [i not in unscored for i in ids]
    w = policy.weights(make_batch(ids, step=step, training=training))
    policy.update(make_batch(ids, step=step, div=divs, scored=scored, training=training), w)
    return w


def online(**kwargs):
    defaults = dict(
        top_k=5, min_count=1, exclude_top_frequent=0, warmup_steps=1, refresh_every=1, window=50, persistence=1
    )
    defaults.update(kwargs)
    p = RockOnlinePolicy(**defaults)
    p.setup(32)
    return p


def torch_round_trip(state):
    """Through `torch.save` / `torch.load(weights_only=True)`, as the trainer's checkpoints do."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture
def clean_registry():
    saved = dict(policies._REGISTRY)
    yield
    policies._REGISTRY.clear()
    policies._REGISTRY.update(saved)


# ---------------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------------
def test_available_policies_lists_builtins_sorted():
    names = available_policies()
    assert set(BUILTINS) <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize(
    "name, cls",
    [
        ("uniform", UniformPolicy),
        ("rock_online", RockOnlinePolicy),
        ("loss_quantile", LossQuantilePolicy),
        ("entropy", EntropyPolicy),
    ],
)
def test_get_policy_returns_registered_class_with_its_name(name, cls):
    p = get_policy(name)
    assert type(p) is cls
    assert p.name == name
    assert repr(p) == f"{cls.__name__}(name={name!r})"


def test_get_policy_passes_kwargs():
    assert get_policy("rock_online", top_k=10, weight=0.5).top_k == 10
    p = get_policy("rock_freeze", token_ids=[4, 2], weight=0.25)
    assert isinstance(p, RockFreezePolicy) and p.token_ids == [4, 2] and p.weight == 0.25
    p = get_policy("random_matched", rock_set=[1], seed=3)
    assert isinstance(p, RandomMatchedPolicy) and p.seed == 3
    assert get_policy("loss_quantile", quantile=0.75).quantile == 0.75
    assert get_policy("entropy", keep_fraction=0.5).keep_fraction == 0.5


def test_get_policy_unknown_name_lists_available():
    with pytest.raises(ValueError, match="Unknown rock_policy 'nope'") as err:
        get_policy("nope")
    for name in BUILTINS:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "name, kwargs, bad, accepted",
    [
        ("rock_online", {"topk": 3}, "'topk'", ["top_k", "min_count", "ema_decay", "weight"]),
        ("loss_quantile", {"keep_fraction": 0.2}, "'keep_fraction'", ["quantile", "weight"]),
        ("entropy", {"quantile": 0.2, "weight": 0.0}, "'quantile'", ["keep_fraction", "weight"]),
        ("rock_freeze", {"token_ids": [1], "ids": [2]}, "'ids'", ["token_ids", "weight"]),
        ("random_matched", {"rock_set": [1], "bins": 3}, "'bins'", ["reference_counts", "num_bins", "seed"]),
    ],
)
def test_get_policy_unknown_kwarg_names_it_and_the_accepted_ones(name, kwargs, bad, accepted):
    with pytest.raises(ValueError, match=f"rock_policy '{name}' does not take {bad}") as err:
        get_policy(name, **kwargs)
    message = str(err.value)
    assert "Accepted keyword arguments" in message
    for a in accepted:
        assert a in message
    with pytest.raises(ValueError, match=bad):
        check_policy_kwargs(name, kwargs)


def test_uniform_takes_no_kwargs_and_says_so():
    # UniformPolicy has no __init__ of its own: the check must not treat object.__init__'s **kwargs as "anything".
    with pytest.raises(ValueError, match=r"'uniform' does not take 'weight'.*Accepted keyword arguments: none"):
        get_policy("uniform", weight=0.0)
    with pytest.raises(ValueError, match="does not take 'weight'"):
        check_policy_kwargs("uniform", {"weight": 0.0})
    check_policy_kwargs("uniform", {})
    with pytest.raises(ValueError, match="Unknown rock_policy 'zzz'"):
        check_policy_kwargs("zzz", {})


def test_register_policy_as_decorator_and_as_call(clean_registry):
    @register_policy("demo_decorated")
    class Decorated(TokenPolicy):
        def weights(self, batch):
            return batch.mask.float() * 2

    class Called(TokenPolicy):
        def weights(self, batch):
            return batch.mask.float() * 3

    assert register_policy("demo_called", Called) is Called
    assert {"demo_decorated", "demo_called"} <= set(available_policies())
    assert Decorated.name == "demo_decorated" and Called.name == "demo_called"
    b = make_batch([[1, 2]], mask=[[True, False]])
    assert get_policy("demo_decorated").weights(b).tolist() == [[2.0, 0.0]]
    assert get_policy("demo_called").weights(b).tolist() == [[3.0, 0.0]]
    # Registering the same class under the same name again is harmless.
    assert register_policy("demo_called", Called) is Called


def test_register_duplicate_name_needs_overwrite(clean_registry):
    class A(TokenPolicy):
        def weights(self, batch):
            return batch.mask.float()

    class B(A):
        pass

    register_policy("demo_dup", A)
    with pytest.raises(ValueError, match=r"'demo_dup' is already registered \(A\).*overwrite=True"):
        register_policy("demo_dup", B)
    assert type(get_policy("demo_dup")) is A
    register_policy("demo_dup", B, overwrite=True)
    assert type(get_policy("demo_dup")) is B
    with pytest.raises(ValueError, match="already registered"):
        register_policy("uniform", A)
    assert type(get_policy("uniform")) is UniformPolicy


def test_register_rejects_non_policies_and_bad_names(clean_registry):
    class NotAPolicy:
        def weights(self, batch):
            return batch.mask.float()

    with pytest.raises(TypeError, match="needs a TokenPolicy subclass"):
        register_policy("demo_bad", NotAPolicy)
    with pytest.raises(TypeError, match="needs a TokenPolicy subclass"):
        register_policy("demo_bad")(UniformPolicy())  # an instance, not a class
    with pytest.raises(TypeError):
        register_policy("demo_bad", lambda batch: batch.mask)
    with pytest.raises(ValueError, match="non-empty strings"):
        register_policy("", UniformPolicy)
    assert "demo_bad" not in available_policies()


def test_third_party_policy_registered_and_used(clean_registry):
    @register_policy("halve_digits_test")
    class HalveDigits(TokenPolicy):
        def __init__(self, digit_ids=(15, 16), factor=0.5):
            self.digit_ids = torch.tensor(list(digit_ids))
            self.factor = factor

        def weights(self, batch):
            return torch.where(torch.isin(batch.token_ids, self.digit_ids), self.factor, 1.0) * batch.mask

    p = get_policy("halve_digits_test", digit_ids=[3], factor=0.25)
    assert isinstance(p, HalveDigits) and p.name == "halve_digits_test"
    w = p.weights(make_batch([[3, 4, 3]], mask=[[True, True, False]]))
    assert w.tolist() == [[0.25, 1.0, 0.0]]
    assert p.rock_ids() is None and p.metrics() == {} and p.state_dict() == {} and p.rock_table() == []
    with pytest.raises(ValueError, match=r"does not take 'digits'.*digit_ids, factor"):
        get_policy("halve_digits_test", digits=[3])


def test_subclass_of_builtin_gets_its_registered_name(clean_registry):
    # Checkpoints record `policy.name`: a subclass must not inherit the parent's name.
    @register_policy("soft_freeze_test")
    class SoftFreeze(RockFreezePolicy):
        def __init__(self, token_ids, weight=0.5):
            super().__init__(token_ids, weight)

    p = get_policy("soft_freeze_test", token_ids=[2])
    assert p.name == "soft_freeze_test"
    assert RockFreezePolicy.name == "rock_freeze"
    assert get_policy("rock_freeze", token_ids=[2]).name == "rock_freeze"
    # A second name for an existing class does not rename it.
    register_policy("uniform_alias_test", UniformPolicy)
    assert get_policy("uniform_alias_test").name == "uniform"


def test_policy_with_var_kwargs_accepts_anything(clean_registry):
    @register_policy("kw_test")
    class KW(TokenPolicy):
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def weights(self, batch):
            return batch.mask.float()

    assert get_policy("kw_test", anything=1, at_all="x").kwargs == {"anything": 1, "at_all": "x"}


def test_parse_policy_kwargs():
    assert parse_policy_kwargs(None) == {}
    assert parse_policy_kwargs("") == {}
    assert parse_policy_kwargs('{"top_k": 3, "weight": 0.5}') == {"top_k": 3, "weight": 0.5}
    src = {"a": 1}
    out = parse_policy_kwargs(src)
    assert out == src and out is not src
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_policy_kwargs("{top_k: 3}")
    with pytest.raises(ValueError, match="must be a dict or a JSON object, got list"):
        parse_policy_kwargs("[1, 2]")


# ---------------------------------------------------------------------------------------------------------------
# bad values
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, kwargs, field, value",
    [
        ("rock_freeze", {"token_ids": [1], "weight": -1.0}, "weight", "-1.0"),
        ("rock_freeze", {"token_ids": [1], "weight": math.inf}, "weight", "inf"),
        ("rock_freeze", {"token_ids": [1], "weight": math.nan}, "weight", "nan"),
        ("rock_online", {"weight": -0.5}, "weight", "-0.5"),
        ("random_matched", {"rock_set": [1], "weight": -2}, "weight", "-2.0"),
        ("loss_quantile", {"weight": -1}, "weight", "-1.0"),
        ("entropy", {"weight": -0.1}, "weight", "-0.1"),
        ("rock_online", {"top_k": 0}, "top_k", "0"),
        ("rock_online", {"top_k": -5}, "top_k", "-5"),
        ("rock_online", {"top_k": 2.5}, "top_k", "2.5"),
        ("rock_online", {"top_k": True}, "top_k", "True"),
        ("rock_online", {"min_count": 0}, "min_count", "0"),
        ("rock_online", {"exclude_top_frequent": -1}, "exclude_top_frequent", "-1"),
        ("rock_online", {"warmup_steps": -1}, "warmup_steps", "-1"),
        ("rock_online", {"refresh_every": 0}, "refresh_every", "0"),
        ("rock_online", {"window": 0}, "window", "0"),
        ("rock_online", {"persistence": 0}, "persistence", "0"),
        ("rock_online", {"stagnation_tol": -0.1}, "stagnation_tol", "-0.1"),
        ("rock_online", {"stagnation_tol": math.inf}, "stagnation_tol", "inf"),
        ("rock_online", {"ema_decay": 0.0}, "ema_decay", "0.0"),
        ("rock_online", {"ema_decay": 1.0}, "ema_decay", "1.0"),
        ("rock_online", {"ema_decay": 1.5}, "ema_decay", "1.5"),
        ("rock_online", {"ema_decay": -0.1}, "ema_decay", "-0.1"),
        ("random_matched", {"rock_set": [1], "num_bins": 0}, "num_bins", "0"),
        ("random_matched", {"rock_set": [1], "warmup_steps": -3}, "warmup_steps", "-3"),
        ("loss_quantile", {"quantile": 0}, "quantile", "0"),
        ("loss_quantile", {"quantile": 1}, "quantile", "1"),
        ("loss_quantile", {"quantile": -0.1}, "quantile", "-0.1"),
        ("loss_quantile", {"quantile": 1.5}, "quantile", "1.5"),
        ("loss_quantile", {"quantile": math.nan}, "quantile", "nan"),
        ("entropy", {"keep_fraction": 0}, "keep_fraction", "0"),
        ("entropy", {"keep_fraction": -0.1}, "keep_fraction", "-0.1"),
        ("entropy", {"keep_fraction": 1.5}, "keep_fraction", "1.5"),
    ],
)
def test_bad_values_raise_naming_field_and_value(name, kwargs, field, value):
    with pytest.raises(ValueError, match=rf"{field}\b.*got {re.escape(value)}\b"):
        get_policy(name, **kwargs)


def test_boundary_values_are_accepted():
    assert get_policy("entropy", keep_fraction=1.0).keep_fraction == 1.0
    assert get_policy("rock_online", exclude_top_frequent=0, warmup_steps=0, stagnation_tol=0.0).warmup_steps == 0
    assert get_policy("rock_online", ema_decay=0.999).ema_decay == 0.999
    assert get_policy("rock_freeze", token_ids=[1], weight=2.0).weight == 2.0
    assert get_policy("rock_online", top_k=3.0).top_k == 3


# ---------------------------------------------------------------------------------------------------------------
# TokenBatch / TokenStatistics
# ---------------------------------------------------------------------------------------------------------------
def test_token_batch_checks_shapes_and_casts_mask():
    with pytest.raises(ValueError, match=r"same shape, got \(1, 3\) and \(1, 2\)"):
        TokenBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), 0)
    b = TokenBatch(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[1, 0]]), 0)
    assert b.mask.dtype == torch.bool and b.mask.tolist() == [[True, False]]
    assert b.training is True and b.divergence is None


def test_token_statistics_counts_valid_and_measures_scored():
    b = make_batch(
        [[1, 1, 2, 3, 3, 0]],
        mask=[[True, True, True, True, True, False]],
        div=[[0.5, 1.5, 2.0, 4.0, 9.0, 100.0]],
        scored=[[True, True, True, True, False, True]],
    )
    s = TokenStatistics.from_batch(b, vocab_size=5)
    assert s.data.dtype == torch.float64 and s.data.shape == (3, 5)
    assert s.count.tolist() == [0.0, 2.0, 1.0, 2.0, 0.0]  # the invalid position (id 0) is not counted
    assert s.divergence_sum.tolist() == [0.0, 2.0, 2.0, 4.0, 0.0]
    assert s.divergence_count.tolist() == [0.0, 2.0, 1.0, 1.0, 0.0]
    mean = s.mean_divergence()
    assert math.isnan(mean[0]) and math.isnan(mean[4])
    assert mean[1:4].tolist() == [1.0, 2.0, 4.0]
    assert s.table([3, 4, 1]) == [
        {"token_id": 3, "count": 2, "mean_divergence": 4.0, "rock_score": 8.0},
        {"token_id": 4, "count": 0, "mean_divergence": None, "rock_score": None},
        {"token_id": 1, "count": 2, "mean_divergence": 1.0, "rock_score": 2.0},
    ]


def test_token_statistics_without_divergence_counts_only():
    s = TokenStatistics.from_batch(make_batch([[2, 2, 1]]), vocab_size=3)
    assert s.count.tolist() == [0.0, 1.0, 2.0]
    assert s.divergence_count.tolist() == [0.0, 0.0, 0.0]
    assert torch.isnan(s.mean_divergence()).all()
    assert TokenStatistics(4).data.abs().sum() == 0


def test_token_statistics_mean_with_fractional_counts():
    # Decayed (EMA) statistics have fractional counts: the mean is still sum / count.
    s = TokenStatistics(3)
    s.data[:, 1] = torch.tensor([0.5, 1.0, 0.5], dtype=torch.float64)
    s.data[:, 2] = torch.tensor([0.25, 0.75, 0.25], dtype=torch.float64)
    assert s.mean_divergence()[1:].tolist() == [2.0, 3.0]


# ---------------------------------------------------------------------------------------------------------------
# uniform
# ---------------------------------------------------------------------------------------------------------------
def test_uniform_weights_are_the_mask():
    b = make_batch([[5, 6, 7], [1, 2, 3]], mask=[[True, False, True], [False, False, True]])
    w = UniformPolicy().weights(b)
    assert w.dtype == torch.float32
    assert w.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    p = UniformPolicy()
    assert p.rock_ids() is None and p.metrics() == {} and p.state_dict() == {}
    assert not p.needs_divergence and not p.needs_entropy


# ---------------------------------------------------------------------------------------------------------------
# rock_freeze
# ---------------------------------------------------------------------------------------------------------------
def test_rock_freeze_zeroes_exactly_the_label_positions():
    p = RockFreezePolicy(token_ids=[7])
    p.setup(20)
    labels = torch.tensor([[7, 5, 7, 9, 7, 7], [1, 7, 7, 2, 0, 0]])
    mask = torch.tensor([[True, True, True, True, True, False], [True, True, True, True, False, False]])
    w = p.weights(TokenBatch(labels, mask, 0))
    expected = torch.where(labels == 7, 0.0, 1.0) * mask
    assert torch.equal(w, expected)
    assert w.tolist() == [[0.0, 1.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    assert not p.needs_divergence and not p.needs_entropy


def test_rock_freeze_uses_labels_not_inputs():
    # Position t predicts labels[t] = input_ids[t + 1]. Freezing id 7 must zero the position that predicts 7,
    # not the one after it, whose input is 7.
    input_ids = torch.tensor([[4, 5, 7, 9, 2]])
    labels = input_ids[:, 1:]  # [5, 7, 9, 2]
    mask = torch.ones_like(labels, dtype=torch.bool)
    p = RockFreezePolicy(token_ids=[7])
    p.setup(10)
    assert p.weights(TokenBatch(labels, mask, 0)).tolist() == [[1.0, 0.0, 1.0, 1.0]]


def test_rock_freeze_soft_weight_and_several_ids():
    p = get_policy("rock_freeze", token_ids=[3, 8], weight=0.3)
    p.setup(10)
    w = p.weights(make_batch([[3, 4, 8, 3, 9]], mask=[[True, True, True, False, True]]))
    assert w[0].tolist() == pytest.approx([0.3, 1.0, 0.3, 0.0, 1.0])
    assert p.rock_ids() == [3, 8]
    assert p.metrics() == {"set_size": 2.0}


def test_rock_freeze_sets_itself_up_without_setup():
    p = RockFreezePolicy(token_ids=[2])
    assert p.rock_table() == [{"token_id": 2}]
    w = p.weights(make_batch([[2, 5, 1]]))
    assert w.tolist() == [[0.0, 1.0, 1.0]]
    assert p.vocab_size == 6


def test_rock_freeze_from_json_file(tmp_path):
    path = tmp_path / "rock_set.json"
    path.write_text(json.dumps({"token_ids": [4, 1], "vocab_size": 10, "tokenizer": "tiny"}))
    p = RockFreezePolicy(token_ids=str(path))
    assert p.token_ids == [4, 1]
    p.setup(10)
    assert p.weights(make_batch([[1, 2, 4, 4]])).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    # pathlib paths and files written by save_rock_set work too.
    path2 = tmp_path / "saved.json"
    save_rock_set(path2, [{"token_id": 6}], vocab_size=10)
    p2 = get_policy("rock_freeze", token_ids=path2, weight=0.5)
    p2.setup(10)
    assert p2.weights(make_batch([[6, 5]])).tolist() == [[0.5, 1.0]]


def test_rock_freeze_file_for_other_vocab(tmp_path):
    path = tmp_path / "big_vocab_rocks.json"
    path.write_text(json.dumps({"token_ids": [4, 1], "vocab_size": 49152}))
    p = RockFreezePolicy(token_ids=str(path))
    with pytest.raises(ValueError, match=r"big_vocab_rocks\.json.*49152.*has 10"):
        p.setup(10)


def test_rock_freeze_ids_outside_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\): \[12\]"):
        RockFreezePolicy(token_ids=[3, 12]).setup(10)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\): \[-1\]"):
        RockFreezePolicy(token_ids=[-1, 3]).setup(10)
    path = tmp_path / "oob.json"
    path.write_text(json.dumps({"token_ids": [10]}))
    with pytest.raises(ValueError, match=r"oob\.json.*outside the vocabulary"):
        RockFreezePolicy(token_ids=path).setup(10)


def test_rock_freeze_empty_or_bad_sets(tmp_path):
    with pytest.raises(ValueError, match="empty token_ids"):
        RockFreezePolicy(token_ids=[])
    with pytest.raises(ValueError, match="duplicates"):
        RockFreezePolicy(token_ids=[1, 1])
    with pytest.raises(ValueError, match="must be integers"):
        RockFreezePolicy(token_ids=[1, 2.0])
    empty = tmp_path / "empty.json"
    empty.write_text('{"token_ids": []}')
    with pytest.raises(ValueError, match=r"empty\.json.*empty token_ids"):
        RockFreezePolicy(token_ids=empty)
    broken = tmp_path / "broken_rocks.json"
    broken.write_text('{"token_ids": [1, 2,')
    with pytest.raises(ValueError, match=r"broken_rocks\.json.*not valid JSON"):
        RockFreezePolicy(token_ids=str(broken))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        RockFreezePolicy(token_ids=str(tmp_path / "missing.json"))


def test_rock_freeze_update_accumulates_and_rock_table():
    p = RockFreezePolicy(token_ids=[7, 9, 3])
    p.setup(12)
    b1 = make_batch([[7, 7, 2, 3, 7]], mask=[[True, True, True, True, False]], div=[[1.0, 3.0, 0.5, 2.0, 50.0]])
    p.update(b1, p.weights(b1))
    b2 = make_batch([[7, 7, 5]], div=[[5.0, 99.0, 1.0]], scored=[[True, False, True]])
    p.update(b2, p.weights(b2))
    # Evaluation batches are not learnt from.
    p.update(make_batch([[7, 3]], div=[[100.0, 100.0]], training=False), None)
    # id 7: 4 valid occurrences, 3 measured (1, 3, 5): mean 3, score 12. id 3: once, 2.0. id 9: never seen.
    assert p.rock_table() == [
        {"token_id": 7, "count": 4, "mean_divergence": 3.0, "rock_score": 12.0},
        {"token_id": 9, "count": 0, "mean_divergence": None, "rock_score": None},
        {"token_id": 3, "count": 1, "mean_divergence": 2.0, "rock_score": 2.0},
    ]
    assert p._stats.count.tolist() == [0, 0, 1, 1, 0, 1, 0, 4, 0, 0, 0, 0]


def test_rock_freeze_state_round_trip():
    p = RockFreezePolicy(token_ids=[7, 1])
    p.setup(10)
    b = make_batch([[7, 1, 7, 4]], div=[[2.0, 1.0, 4.0, 0.5]])
    p.update(b, p.weights(b))
    state = p.state_dict()
    snapshot = state["stats"].clone()
    # Later updates must not leak into a state already handed out (it may not be written to disk yet).
    p.update(b, p.weights(b))
    assert torch.equal(state["stats"], snapshot)

    q = RockFreezePolicy(token_ids=[7, 1])
    q.setup(10)
    q.load_state_dict(torch_round_trip(state))
    assert q.rock_table() == [
        {"token_id": 7, "count": 2, "mean_divergence": 3.0, "rock_score": 6.0},
        {"token_id": 1, "count": 1, "mean_divergence": 1.0, "rock_score": 1.0},
    ]
    # The loaded policy keeps its own copy.
    q.update(b, q.weights(b))
    assert torch.equal(state["stats"], snapshot)
    assert q.rock_table() == p.rock_table()

    other = RockFreezePolicy(token_ids=[7, 2])
    other.setup(10)
    with pytest.raises(ValueError, match=r"another rock set \(2 ids\)"):
        other.load_state_dict(state)


# ---------------------------------------------------------------------------------------------------------------
# rock_online
# ---------------------------------------------------------------------------------------------------------------
def test_rock_online_needs_setup():
    p = RockOnlinePolicy()
    assert p.rock_ids() == [] and p.rock_table() == [] and p.state_dict() == {}
    assert p.metrics() == {"set_size": 0.0}
    with pytest.raises(RuntimeError, match=r"setup\(vocab_size\)"):
        p.weights(make_batch([[1]]))
    assert not p.needs_divergence and not p.needs_entropy


def test_rock_online_stagnant_becomes_rock_improving_does_not():
    p = online(top_k=3, warmup_steps=2, refresh_every=2, window=2, persistence=2, stagnation_tol=0.1)
    background = [(i, 0.01) for i in range(10, 15)]
    for step in range(5):
        late = step >= 2
        pairs = (
            occ(3, 2, 5.0)  # stagnant
            + occ(4, 2, 1.0 if late else 5.0)  # improving: falls by 80%
            + occ(5, 2, 4.75 if late else 5.0)  # falls by 5%, within stagnation_tol
            + background
        )
        w = online_step(p, step, pairs)
        if step < 4:
            # First refresh at step 2 has no history to compare with (persistence=2): no rocks yet.
            assert p.rock_ids() == [], step
            assert w.tolist() == [[1.0] * len(pairs)]
    assert p._refreshes == 2
    assert p._candidates == [3, 5, 4]
    assert p.rock_ids() == [3, 5]
    w = p.weights(make_batch([[3, 4, 5, 10]], step=4))
    assert w.tolist() == [[0.0, 1.0, 0.0, 1.0]]


def test_rock_online_persistence_one_freezes_at_first_refresh():
    p = online(top_k=1, warmup_steps=1, persistence=1)
    online_step(p, 0, occ(3, 2, 5.0) + occ(4, 2, 1.0))
    online_step(p, 1, occ(3, 2, 5.0))
    assert p.rock_ids() == [3]


def test_rock_online_excludes_top_frequent():
    pairs = occ(1, 10, 5.0) + occ(3, 2, 5.0) + occ(6, 1, 0.0)
    p = online(exclude_top_frequent=1)
    online_step(p, 0, pairs)
    online_step(p, 1, pairs)
    assert p.rock_ids() == [3]  # id 1 has the best score but is the most frequent; id 6 has score 0
    q = online(exclude_top_frequent=0)
    online_step(q, 0, pairs)
    online_step(q, 1, pairs)
    assert q.rock_ids() == [1, 3]


def test_rock_online_min_count():
    pairs = occ(9, 1, 100.0) + occ(3, 2, 1.0)
    for min_count, expected in [(3, [3]), (2, [9, 3])]:
        p = online(min_count=min_count, warmup_steps=2)
        for step in range(3):
            online_step(p, step, pairs)
        # Over steps 0-1: id 9 seen twice (score 200), id 3 four times (score 4).
        assert p._totals.count[9] == 2 and p._totals.count[3] == 4
        assert p.rock_ids() == expected


def test_rock_online_top_k_limits_set():
    divs = {2: 0.5, 3: 3.0, 4: 1.0, 5: 2.5, 6: 0.1, 7: 2.0}
    pairs = [p for i, d in divs.items() for p in occ(i, 2, d)]
    for k, expected in [(1, [3]), (3, [3, 5, 7]), (10, [3, 5, 7, 4, 2, 6])]:
        p = online(top_k=k)
        online_step(p, 0, pairs)
        online_step(p, 1, pairs)
        assert p.rock_ids() == expected


def test_rock_online_window_expiry():
    p = online(window=2)
    online_step(p, 0, occ(5, 3, 2.0))
    online_step(p, 1, occ(6, 1, 1.0))
    assert p._totals.count[5] == 3 and p._totals.divergence_sum[5] == 6.0
    assert p.rock_ids() == [5]
    online_step(p, 2, occ(6, 1, 1.0))
    assert p._totals.count[5] == 3 and p._totals.count[6] == 1
    assert p.rock_ids() == [5, 6]
    online_step(p, 3, occ(6, 1, 1.0))
    # The window now holds steps 1 and 2 only: step 0's id 5 is gone.
    assert len(p._window) == 2
    assert p._totals.count[5] == 0 and p._totals.divergence_count[5] == 0
    assert abs(float(p._totals.divergence_sum[5])) < 1e-12
    assert p._totals.count[6] == 2 and p._totals.divergence_sum[6] == 2.0
    assert p.rock_ids() == [6]
    assert p._totals.count.sum() == 2


def test_rock_online_ema_decay():
    p = online(ema_decay=0.5, top_k=1, warmup_steps=2, persistence=2)
    online_step(p, 0, occ(5, 2, 2.0) + occ(7, 2, 0.1) + occ(8, 1, 4.0))
    for step in range(1, 4):
        online_step(p, step, occ(5, 2, 2.0) + occ(7, 2, 0.1))
    online_step(p, 4, occ(5, 2, 2.0))
    # Steps 0-3 committed, each decayed by 0.5 per later step: 2 * (1 + 0.5 + 0.25 + 0.125).
    assert p._totals.count[5].item() == pytest.approx(3.75)
    assert p._totals.count[8].item() == pytest.approx(0.125)
    assert len(p._window) == 0
    mean = p._totals.mean_divergence()
    assert mean[5].item() == pytest.approx(2.0)
    assert mean[7].item() == pytest.approx(0.1)
    assert mean[8].item() == pytest.approx(4.0)  # seen once, long ago: still its mean, not a decayed one
    assert p.rock_ids() == [5]


@pytest.mark.parametrize("ema_decay", [None, 0.5])
def test_rock_online_frozen_rock_stays_frozen_when_no_longer_measured(ema_decay):
    # Once frozen, the trainer no longer projects a rock: its divergence is carried forward, so it stays a rock.
    p = online(ema_decay=ema_decay, window=3, top_k=1, warmup_steps=2, persistence=2, stagnation_tol=0.1)
    online_step(p, 0, occ(5, 2, 3.0) + occ(6, 2, 0.2))
    online_step(p, 1, occ(5, 2, 3.0) + occ(6, 2, 0.2))
    online_step(p, 2, occ(5, 2, 3.0) + occ(6, 2, 0.2))
    online_step(p, 3, occ(5, 2, 3.0) + occ(6, 2, 0.2))
    assert p.rock_ids() == [5]
    for step in range(4, 16):
        w = online_step(p, step, occ(5, 2, 3.0) + occ(6, 2, 0.2), unscored={5})
        assert p.rock_ids() == [5], step
        assert w.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert p._last_mean[5].item() == pytest.approx(3.0)


def test_rock_online_refresh_schedule():
    p = online(warmup_steps=4, refresh_every=3)
    refreshes = []
    for step in range(12):
        for _ in range(2):  # gradient accumulation: several micro-batches per step
            online_step(p, step, occ(3, 2, 9.0) + occ(4, 1, 0.1))
        refreshes.append(p._refreshes)
        if step < 4:
            assert p.rock_ids() == []
    assert refreshes == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert p.rock_ids() == [3, 4]
    # A step's statistics are committed once it is over: 4 micro-batch occurrences of id 3 per step, steps 0-10.
    assert p._totals.count[3] == 4 * 11


def test_rock_online_rocks_get_weight_others_one_invalid_zero():
    p = online(weight=0.25, top_k=2)
    online_step(p, 0, occ(3, 2, 5.0) + occ(4, 2, 4.0) + occ(5, 2, 0.0))
    w = p.weights(
        make_batch([[3, 4, 5, 6, 3], [4, 0, 0, 0, 0]], mask=[[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], step=1)
    )
    assert p.rock_ids() == [3, 4]
    assert w.tolist() == [[0.25, 0.25, 1.0, 1.0, 0.0], [0.25, 0.0, 0.0, 0.0, 0.0]]


def test_rock_online_eval_batches_do_not_change_statistics():
    p = online(window=3)
    for step in range(3):
        online_step(p, step, occ(3, 2, 5.0) + occ(4, 1, 1.0))
    before = copy.deepcopy(p.state_dict())
    # An evaluation pass, even at a later step and with other tokens, leaves everything as it was.
    w = online_step(p, 50, occ(8, 5, 100.0) + occ(3, 1, 0.0), training=False)
    assert w.tolist() == [[1.0] * 5 + [0.0]]  # but uses the current rocks
    after = p.state_dict()
    assert after.keys() == before.keys()
    for key in before:
        a, b = before[key], after[key]
        if torch.is_tensor(a):
            assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0)), key
        elif key in ("window_ids", "window_values"):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), key
        else:
            assert a == b, key
    assert p._step == 2


def _random_pairs(step, micro, vocab=30):
    g = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(0, vocab, (24,), generator=g)
    # Divergence grows with the id (ids 20+ are hard), plus noise.
    divs = ids.double() / 10 + torch.rand(24, generator=g, dtype=torch.float64) * 0.2
    return list(zip(ids.tolist(), divs.tolist(), strict=True))


def test_rock_online_state_round_trip_continues_identically():
    kwargs = dict(
        top_k=4, min_count=2, exclude_top_frequent=2, warmup_steps=3, refresh_every=2, window=4, persistence=2
    )
    a = RockOnlinePolicy(**kwargs)
    a.setup(30)
    for step in range(8):
        for micro in range(2):
            online_step(a, step, _random_pairs(step, micro))
    assert a._pending.count.sum() > 0  # saved mid-step, with pending statistics
    state = torch_round_trip(a.state_dict())
    b = RockOnlinePolicy(**kwargs)
    b.load_state_dict(state)  # sets itself up from the saved vocabulary size
    assert b.vocab_size == 30
    assert b.rock_ids() == a.rock_ids() and b.metrics() == a.metrics()
    assert torch.equal(b._totals.data, a._totals.data)
    seen_rocks = set(a.rock_ids())
    for step in range(8, 24):
        for micro in range(2):
            pairs = _random_pairs(step, micro)
            wa, wb = online_step(a, step, pairs), online_step(b, step, pairs)
            assert torch.equal(wa, wb)
        assert a.rock_ids() == b.rock_ids(), step
        assert torch.equal(a._totals.data, b._totals.data), step
        assert a.metrics() == b.metrics()
        seen_rocks |= set(a.rock_ids())
    assert seen_rocks  # the scenario does find rocks
    assert a.rock_table() == b.rock_table()


def test_rock_online_load_state_checks_vocab():
    a = online()
    online_step(a, 0, occ(3, 2, 1.0))
    b = RockOnlinePolicy()
    b.setup(64)
    with pytest.raises(ValueError, match="vocabulary of 32 tokens.*has 64"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict({})  # an empty state (saved before setup) is a no-op
    assert b.vocab_size == 64


def test_rock_online_metrics_and_jaccard():
    p = online(top_k=5, window=1)
    assert p.metrics() == {"set_size": 0.0, "candidates": 0.0}
    online_step(p, 0, occ(3, 2, 5.0))
    online_step(p, 1, occ(3, 2, 5.0) + occ(4, 2, 5.0))
    assert p.rock_ids() == [3]
    assert p.metrics() == {"set_size": 1.0, "candidates": 1.0, "jaccard_prev": 0.0}
    online_step(p, 2, occ(4, 2, 5.0))
    assert p.rock_ids() == [3, 4]
    assert p.metrics() == {"set_size": 2.0, "candidates": 2.0, "jaccard_prev": 0.5}
    online_step(p, 3, occ(4, 2, 5.0))
    assert p.rock_ids() == [4]
    assert p.metrics()["jaccard_prev"] == 0.5
    online_step(p, 4, occ(4, 2, 5.0))
    assert p.metrics()["jaccard_prev"] == 1.0


def test_rock_online_rock_table():
    p = online(top_k=2)
    online_step(p, 0, occ(3, 3, 2.0) + occ(4, 1, 1.0) + occ(5, 4, 0.5) + occ(6, 2, 0.0))
    online_step(p, 1, [])
    assert p.rock_ids() == [3, 5]
    assert p.rock_table() == [
        {"token_id": 3, "count": 3, "frequency": 0.3, "mean_divergence": 2.0, "rock_score": 6.0},
        {"token_id": 5, "count": 4, "frequency": 0.4, "mean_divergence": 0.5, "rock_score": 2.0},
    ]


# ---------------------------------------------------------------------------------------------------------------
# random_matched
# ---------------------------------------------------------------------------------------------------------------
def _skewed_reference(vocab=1000, n_frequent=100, seed=0):
    rng = np.random.default_rng(seed)
    counts = {i: int(1000 + rng.integers(0, 500)) for i in range(n_frequent)}
    counts.update({i: int(rng.integers(1, 6)) for i in range(n_frequent, vocab)})
    return counts


ROCKS = [3, 17, 42, 60, 88]


def test_random_matched_with_reference_counts_is_frequency_matched():
    ref = _skewed_reference()
    p = get_policy("random_matched", rock_set=ROCKS, reference_counts=ref, num_bins=10, seed=0)
    p.setup(1000)
    control = p.rock_ids()
    assert len(control) == len(ROCKS) == len(set(control))
    assert not set(control) & set(ROCKS)
    # The rocks are all frequent, so is their control (a uniform draw would be ~90% rare ids).
    assert all(ref[c] >= 1000 for c in control), control
    rng = np.random.default_rng(0)
    uniform = rng.choice(np.setdiff1d(np.arange(1000), ROCKS), size=200, replace=False)
    assert np.mean([ref[int(i)] < 1000 for i in uniform]) > 0.7
    m = p.metrics()
    assert m["set_size"] == 5.0
    assert m["match_ks"] < 0.5
    # The control ids are frozen; the rocks themselves are not.
    ids = [ROCKS[0], control[0], 500, control[1]]
    w = p.weights(make_batch([ids], mask=[[True, True, True, False]], step=0))
    assert w.tolist() == [[1.0, 0.0, 1.0, 0.0]]


def test_random_matched_ks_small_across_spread_rocks():
    rng = np.random.default_rng(5)
    counts = np.floor(np.exp(rng.uniform(0, 9, 3000))).astype(int) + 1
    ref = {i: int(c) for i, c in enumerate(counts)}
    rocks = rng.choice(3000, size=30, replace=False).tolist()
    p = RandomMatchedPolicy(rock_set=rocks, reference_counts=ref, num_bins=10, seed=1)
    p.setup(3000)
    assert p.metrics()["match_ks"] < 0.5
    # An unmatched draw restricted to rare ids is far off, so the statistic is meaningful.
    from scipy.stats import ks_2samp

    rare = [i for i in range(3000) if counts[i] < 5][:30]
    assert ks_2samp(np.log1p(counts[rocks]), np.log1p(counts[rare])).statistic > 0.5


def test_random_matched_seeds():
    ref = _skewed_reference()

    def draw(seed):
        p = RandomMatchedPolicy(rock_set=ROCKS, reference_counts=ref, seed=seed)
        p.setup(1000)
        return p.rock_ids()

    assert draw(0) == draw(0)
    assert draw(1) == draw(1)
    assert draw(0) != draw(1)
    assert len({tuple(draw(s)) for s in range(5)}) > 1


def test_random_matched_reference_counts_from_file(tmp_path):
    ref = {str(k): v for k, v in _skewed_reference().items()}
    nested = tmp_path / "counts.json"
    nested.write_text(json.dumps({"counts": ref, "source": "corpus"}))
    flat = tmp_path / "flat_counts.json"
    flat.write_text(json.dumps(ref))
    rocks_file = tmp_path / "rock_set.json"
    save_rock_set(rocks_file, [{"token_id": i} for i in ROCKS], vocab_size=1000)
    direct = RandomMatchedPolicy(rock_set=ROCKS, reference_counts=_skewed_reference(), seed=4)
    direct.setup(1000)
    for counts_path in (nested, str(flat)):
        p = RandomMatchedPolicy(rock_set=str(rocks_file), reference_counts=counts_path, seed=4)
        p.setup(1000)
        assert p.rock_token_ids == ROCKS
        assert p.rock_ids() == direct.rock_ids()


def test_random_matched_bad_inputs(tmp_path):
    bad = tmp_path / "bad_counts.json"
    bad.write_text("{oops")
    with pytest.raises(ValueError, match=r"bad_counts\.json.*could not be read"):
        RandomMatchedPolicy(rock_set=[1], reference_counts=str(bad)).setup(10)
    with pytest.raises(ValueError, match=r"could not be read"):
        RandomMatchedPolicy(rock_set=[1], reference_counts=str(tmp_path / "none.json")).setup(10)
    with pytest.raises(ValueError, match=r"id 12 outside the vocabulary \[0, 10\)"):
        RandomMatchedPolicy(rock_set=[1], reference_counts={1: 3, 12: 4}).setup(10)
    lst = tmp_path / "list_counts.json"
    lst.write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="must map token ids to counts"):
        RandomMatchedPolicy(rock_set=[1], reference_counts=str(lst)).setup(10)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\)"):
        RandomMatchedPolicy(rock_set=[1, 10]).setup(10)
    with pytest.raises(ValueError, match="empty token_ids"):
        RandomMatchedPolicy(rock_set=[]).setup(10)
    with pytest.raises(ValueError, match="Cannot draw a frequency-matched control"):
        RandomMatchedPolicy(rock_set=[0, 1], reference_counts={0: 5, 1: 5, 2: 5}, num_bins=1).setup(3)
    with pytest.raises(RuntimeError, match=r"setup\(vocab_size\)"):
        RandomMatchedPolicy(rock_set=[1]).weights(make_batch([[1]]))


def _warmup_pairs():
    # ids 0-9 are frequent (20 per step); ids 10-39 appear once each over the three warmup steps.
    return lambda step: [i for i in range(10) for _ in range(20)] + list(range(10 + 10 * step, 20 + 10 * step))


def test_random_matched_counts_during_warmup_then_draws():
    p = RandomMatchedPolicy(rock_set=[0, 1], warmup_steps=3, num_bins=4, seed=0)
    p.setup(64)
    ids_at = _warmup_pairs()
    for step in range(3):
        b = make_batch([ids_at(step)], step=step)
        w = p.weights(b)
        assert torch.equal(w, torch.ones_like(w))  # nothing frozen while counting
        assert p.rock_ids() == []
        p.update(b, w)
        assert p.metrics() == {"set_size": 0.0}
    assert p._counts.count[:10].tolist() == [60.0] * 10
    assert p._counts.count[10:40].tolist() == [1.0] * 30
    # An evaluation batch past warmup does not trigger the draw.
    p.weights(make_batch([[0, 1]], step=3, training=False))
    assert p.rock_ids() == []
    w = p.weights(make_batch([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50]], step=3))
    control = p.rock_ids()
    assert len(control) == 2 and not set(control) & {0, 1}
    assert all(2 <= c <= 9 for c in control), control  # frequent, like the rocks
    assert p.metrics()["match_ks"] < 0.5
    expected = [0.0 if i in control else 1.0 for i in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50]]
    assert w.tolist() == [expected]
    # Counting stops after the draw, and the draw is not redone.
    counts = p._counts.data.clone()
    b = make_batch([[50, 50, 51]], step=4)
    p.update(b, p.weights(b))
    assert torch.equal(p._counts.data, counts)
    assert p.rock_ids() == control


def test_random_matched_postpones_the_draw_until_enough_ids_are_seen(caplog):
    # Found by the property test below: a warm-up that saw only the rock ids (or nothing) left no id to match with,
    # and the draw raised mid-training. Now the policy keeps counting, warns once, and draws when it can.
    from transformers.utils import logging as hf_logging

    p = RandomMatchedPolicy(rock_set=[1, 2], warmup_steps=1, num_bins=2)
    p.setup(16)
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            for step in range(3):
                b = make_batch([[1, 2, 1, 2]], step=step)
                w = p.weights(b)
                assert torch.equal(w, torch.ones_like(w)) and p.rock_ids() == []
                p.update(b, w)
    finally:
        hf_logging.disable_propagation()
    warnings = [r for r in caplog.records if "only 0 non-rock ids are available" in r.getMessage()]
    assert len(warnings) == 1
    b = make_batch([[5, 6, 7, 1]], step=3)
    p.update(b, p.weights(b))  # still undrawn at step 3: 0 non-rock ids were counted before this batch
    w = p.weights(make_batch([[5, 6, 7, 1]], step=4))
    assert len(p.rock_ids()) == 2 and set(p.rock_ids()) <= {5, 6, 7}


def test_random_matched_state_round_trip():
    ids_at = _warmup_pairs()
    a = RandomMatchedPolicy(rock_set=[0, 1], warmup_steps=3, num_bins=4, seed=2)
    a.setup(64)
    for step in range(2):
        b = make_batch([ids_at(step)], step=step)
        a.update(b, a.weights(b))
    # Before the draw: counts carry over, and both draw the same control later.
    b_policy = RandomMatchedPolicy(rock_set=[0, 1], warmup_steps=3, num_bins=4, seed=2)
    b_policy.setup(64)
    b_policy.load_state_dict(torch_round_trip(a.state_dict()))
    assert torch.equal(b_policy._counts.data, a._counts.data)
    for p in (a, b_policy):
        b = make_batch([ids_at(2)], step=2)
        p.update(b, p.weights(b))
        p.weights(make_batch([[0]], step=3))
    assert a.rock_ids() == b_policy.rock_ids() and len(a.rock_ids()) == 2
    # After the draw: the control, its weights and metrics carry over.
    c = RandomMatchedPolicy(rock_set=[0, 1], warmup_steps=3, num_bins=4, seed=99)
    c.setup(64)
    c.load_state_dict(torch_round_trip(a.state_dict()))
    assert c.rock_ids() == a.rock_ids()
    assert c.metrics() == a.metrics()
    batch = make_batch([list(range(12))], step=5)
    assert torch.equal(c.weights(batch), a.weights(batch))
    assert RandomMatchedPolicy(rock_set=[0]).state_dict() == {}


# ---------------------------------------------------------------------------------------------------------------
# loss_quantile
# ---------------------------------------------------------------------------------------------------------------
def test_loss_quantile_weights_positions_above_quantile():
    p = get_policy("loss_quantile", quantile=0.5, weight=0.5)
    assert p.needs_divergence and not p.needs_entropy
    b = make_batch(
        [[1, 2, 3, 4, 5]], mask=[[True, True, True, True, False]], div=[[0.1, 0.2, 0.3, 5.0, 100.0]]
    )
    # Median of the valid values (0.1, 0.2, 0.3, 5.0) is 0.25; the invalid 100.0 is ignored and gets 0.
    assert p.weights(b).tolist() == [[1.0, 1.0, 0.5, 0.5, 0.0]]


def test_loss_quantile_matches_numpy_quantile():
    g = torch.Generator().manual_seed(0)
    div = torch.rand(3, 40, generator=g)
    mask = torch.rand(3, 40, generator=g) > 0.3
    b = TokenBatch(torch.zeros(3, 40, dtype=torch.long), mask, 0, divergence=div, scored=mask)
    for q in (0.1, 0.5, 0.9):
        w = LossQuantilePolicy(quantile=q, weight=0.0).weights(b)
        threshold = np.quantile(div[mask].numpy(), q)
        above = mask & (div > float(threshold))
        assert torch.equal(w == 0, above | ~mask)
        assert torch.equal(w == 1, mask & ~above)
        assert int(above.sum()) == pytest.approx((1 - q) * int(mask.sum()), abs=1)


def test_loss_quantile_ties_and_empty():
    p = LossQuantilePolicy(quantile=0.9)
    b = make_batch([[1, 2, 3]], div=[[2.0, 2.0, 2.0]])
    assert p.weights(b).tolist() == [[1.0, 1.0, 1.0]]  # nothing strictly above
    b = make_batch([[1, 2]], mask=[[False, False]], div=[[5.0, 6.0]])
    assert p.weights(b).tolist() == [[0.0, 0.0]]


def test_loss_quantile_needs_divergence():
    with pytest.raises(ValueError, match="loss_quantile needs batch.divergence"):
        LossQuantilePolicy().weights(make_batch([[1, 2]]))


# ---------------------------------------------------------------------------------------------------------------
# entropy
# ---------------------------------------------------------------------------------------------------------------
def test_entropy_keeps_highest_entropy_valid_positions():
    p = get_policy("entropy", keep_fraction=0.3, weight=0.1)
    assert p.needs_entropy and not p.needs_divergence
    ent = [[0.5, 9.0, 0.1, 3.0, 2.0, 50.0], [1.0, 0.2, 4.0, 0.3, 0.0, 0.0]]
    mask = [[True, True, True, True, True, False], [True, True, True, True, False, False]]
    w = p.weights(make_batch(torch.zeros(2, 6, dtype=torch.long), mask=mask, entropy=ent))
    # 9 valid positions: keep ceil(2.7) = 3 highest (9.0, 4.0, 3.0); the invalid 50.0 is never kept.
    assert w.flatten().tolist() == pytest.approx([0.1, 1.0, 0.1, 1.0, 0.1, 0.0] + [0.1, 0.1, 1.0, 0.1, 0.0, 0.0])


@pytest.mark.parametrize("n_valid", [1, 7, 10, 25, 50, 100, 150])
def test_entropy_keeps_exactly_ceil_fraction(n_valid):
    g = torch.Generator().manual_seed(n_valid)
    ent = torch.randperm(n_valid + 5, generator=g).float()[None]
    mask = torch.zeros(1, n_valid + 5, dtype=torch.bool)
    mask[0, :n_valid] = True
    b = TokenBatch(torch.zeros_like(mask, dtype=torch.long), mask, 0, student_entropy=ent, scored=mask)
    for pct in range(1, 101):
        w = EntropyPolicy(keep_fraction=pct / 100, weight=0.0).weights(b)
        expected_k = max(1, math.ceil(Fraction(pct, 100) * n_valid))
        kept = w == 1.0
        assert int(kept.sum()) == expected_k, (pct, n_valid)
        assert not (kept & ~mask).any()
        # The kept ones are the highest-entropy valid positions.
        valid_ent = ent[mask]
        assert ent[kept].min() >= valid_ent.sort(descending=True).values[expected_k - 1]
        assert (w[~mask] == 0).all()


def test_entropy_edge_cases():
    b = make_batch([[1, 2, 3, 4]], mask=[[True, True, True, False]], entropy=[[0.1, 0.2, 0.3, 0.4]])
    assert EntropyPolicy(keep_fraction=1.0).weights(b).tolist() == [[1.0, 1.0, 1.0, 0.0]]
    assert EntropyPolicy(keep_fraction=1e-6).weights(b).tolist() == [[0.0, 0.0, 1.0, 0.0]]  # at least one
    none_valid = make_batch([[1, 2]], mask=[[False, False]], entropy=[[1.0, 2.0]])
    assert EntropyPolicy(weight=0.5).weights(none_valid).tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="entropy needs batch.student_entropy"):
        EntropyPolicy().weights(make_batch([[1, 2]]))


# ---------------------------------------------------------------------------------------------------------------
# property test: every policy returns sane weights
# ---------------------------------------------------------------------------------------------------------------
VOCAB = 16


def _all_policies():
    out = [
        UniformPolicy(),
        RockFreezePolicy(token_ids=[1, 2], weight=0.3),
        RockOnlinePolicy(top_k=3, min_count=1, exclude_top_frequent=1, warmup_steps=1, refresh_every=1, window=3,
                         persistence=1, weight=0.5),
        RandomMatchedPolicy(rock_set=[1, 2], reference_counts={i: i + 1 for i in range(VOCAB)}, num_bins=2),
        RandomMatchedPolicy(rock_set=[1, 2], warmup_steps=1, num_bins=2),
        LossQuantilePolicy(quantile=0.7, weight=0.2),
        EntropyPolicy(keep_fraction=0.4, weight=0.1),
    ]
    for p in out:
        p.setup(VOCAB)
    return out


@st.composite
def token_batches(draw):
    b = draw(st.integers(1, 3))
    t = draw(st.integers(1, 8))
    n = b * t
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    div = draw(st.lists(st.floats(0, 10, allow_nan=False), min_size=n, max_size=n))
    ent = draw(st.lists(st.floats(0, 10, allow_nan=False), min_size=n, max_size=n))
    return (
        torch.tensor(ids).view(b, t),
        torch.tensor(mask).view(b, t),
        torch.tensor(div, dtype=torch.float32).view(b, t),
        torch.tensor(ent, dtype=torch.float32).view(b, t),
    )


@settings(max_examples=40, deadline=None)
@given(batches=st.lists(token_batches(), min_size=1, max_size=4))
def test_every_policy_returns_sane_weights(batches):
    for policy in _all_policies():
        for step, (ids, mask, div, ent) in enumerate(batches):
            batch = TokenBatch(ids, mask, step, divergence=div, student_entropy=ent, scored=mask)
            w = policy.weights(batch)
            assert w.shape == mask.shape, policy
            assert w.dtype == torch.float32, policy
            assert torch.isfinite(w).all(), policy
            assert (w >= 0).all(), policy
            assert (w[~mask] == 0).all(), policy
            policy.update(batch, w)
