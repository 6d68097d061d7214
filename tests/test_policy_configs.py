"""Tests of the built-in policies' typed options (`hf_rockopd.policies.configs`) and the one place that checks them."""

import dataclasses
import json
import math
import re

import pytest
import torch
from transformers import HfArgumentParser

from conftest import make_args
from hf_rockopd.policies import (
    EntropyConfig,
    EntropyPolicy,
    LossQuantileConfig,
    LossQuantilePolicy,
    PolicyConfig,
    RandomMatchedConfig,
    RandomMatchedPolicy,
    RockFreezeConfig,
    RockFreezePolicy,
    RockOnlineConfig,
    RockOnlinePolicy,
    TokenBatch,
    TokenPolicy,
    UniformConfig,
    UniformPolicy,
    available_policies,
    build_policy_options,
    get_policy,
    policy_config_class,
    register_policy,
)


CONFIGS = {
    "uniform": (UniformConfig, UniformPolicy, {}),
    "rock_freeze": (RockFreezeConfig, RockFreezePolicy, {"token_ids": [3, 1]}),
    "rock_online": (RockOnlineConfig, RockOnlinePolicy, {}),
    "random_matched": (RandomMatchedConfig, RandomMatchedPolicy, {"rock_set": [1, 2]}),
    "loss_quantile": (LossQuantileConfig, LossQuantilePolicy, {}),
    "entropy": (EntropyConfig, EntropyPolicy, {}),
}


def test_every_builtin_has_its_options_dataclass():
    assert {name for name in CONFIGS} <= set(available_policies())
    for name, (config_class, policy_class, _) in CONFIGS.items():
        assert policy_config_class(name) is config_class
        assert policy_class.config_class is config_class
        assert issubclass(config_class, PolicyConfig) and dataclasses.is_dataclass(config_class)


@pytest.mark.parametrize("config_class", [c for c, _, _ in CONFIGS.values()], ids=lambda c: c.__name__)
def test_every_field_has_help_and_nothing_argparse_would_reject(config_class):
    for f in dataclasses.fields(config_class):
        assert isinstance(f.metadata.get("help"), str) and len(f.metadata["help"]) > 10, f.name
        # HfArgumentParser hands the metadata to `add_argument` as keyword arguments.
        assert set(f.metadata) <= {"help", "choices", "aliases"}, f.name


@pytest.mark.parametrize(
    "config_class, kwargs, field, value",
    [
        (RockFreezeConfig, {"token_ids": [1], "weight": -1.0}, "weight", "-1.0"),
        (RockFreezeConfig, {"token_ids": [1], "weight": math.nan}, "weight", "nan"),
        (RockFreezeConfig, {"weight": 0.0}, "token_ids", "None"),
        (RockFreezeConfig, {"token_ids": []}, "token_ids", "empty"),
        (RockFreezeConfig, {"token_ids": [1, 1]}, "token_ids", "duplicates"),
        (RockFreezeConfig, {"token_ids": [1, 2.5]}, "token_ids", "2.5"),
        (RockOnlineConfig, {"top_k": 0}, "top_k", "0"),
        (RockOnlineConfig, {"top_k": True}, "top_k", "True"),
        (RockOnlineConfig, {"min_count": 0}, "min_count", "0"),
        (RockOnlineConfig, {"exclude_top_frequent": -1}, "exclude_top_frequent", "-1"),
        (RockOnlineConfig, {"warmup_steps": -2}, "warmup_steps", "-2"),
        (RockOnlineConfig, {"refresh_every": 0}, "refresh_every", "0"),
        (RockOnlineConfig, {"window": 0}, "window", "0"),
        (RockOnlineConfig, {"ema_decay": 1.0}, "ema_decay", "1.0"),
        (RockOnlineConfig, {"persistence": 0}, "persistence", "0"),
        (RockOnlineConfig, {"stagnation_tol": -0.1}, "stagnation_tol", "-0.1"),
        (RockOnlineConfig, {"weight": math.inf}, "weight", "inf"),
        (RandomMatchedConfig, {}, "rock_set", "None"),
        (RandomMatchedConfig, {"rock_set": [1], "warmup_steps": -1}, "warmup_steps", "-1"),
        (RandomMatchedConfig, {"rock_set": [1], "num_bins": 0}, "num_bins", "0"),
        (RandomMatchedConfig, {"rock_set": [1], "weight": -3}, "weight", "-3.0"),
        (LossQuantileConfig, {"quantile": 1.0}, "quantile", "1.0"),
        (LossQuantileConfig, {"quantile": math.nan}, "quantile", "nan"),
        (LossQuantileConfig, {"weight": -1}, "weight", "-1.0"),
        (EntropyConfig, {"keep_fraction": 0.0}, "keep_fraction", "0.0"),
        (EntropyConfig, {"keep_fraction": 1.01}, "keep_fraction", "1.01"),
        (EntropyConfig, {"weight": -0.5}, "weight", "-0.5"),
    ],
)
def test_bad_values_raise_value_error_naming_field_and_value(config_class, kwargs, field, value):
    with pytest.raises(ValueError) as err:
        config_class(**kwargs)
    assert re.search(rf"\b{field}\b", str(err.value)) and value in str(err.value), str(err.value)


def test_values_are_normalized_once():
    assert RockOnlineConfig(top_k=3.0, weight=1).top_k == 3 and RockOnlineConfig(weight=1).weight == 1.0
    assert RockOnlineConfig(ema_decay=0.5).ema_decay == 0.5 and RockOnlineConfig().ema_decay is None
    assert RockFreezeConfig(token_ids=(4, 2)).token_ids == [4, 2]
    assert RockFreezeConfig(token_ids="rocks.json").token_ids == "rocks.json"  # a file is read by the policy
    assert RandomMatchedConfig(rock_set=[1], seed="7").seed == 7


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rock_policy_kwargs_as_dict_or_json_build_the_same_options(name, tmp_path):
    config_class, policy_class, required = CONFIGS[name]
    options = dict(required, **({"weight": 0.5} if name != "uniform" else {}))
    from_dict = make_args(tmp_path, rock_policy=name, rock_policy_kwargs=options)
    from_json = make_args(tmp_path, rock_policy=name, rock_policy_kwargs=json.dumps(options))
    assert from_dict.rock_policy_kwargs == from_json.rock_policy_kwargs == build_policy_options(name, options)
    config = config_class(**from_json.rock_policy_kwargs)
    assert config == config_class(**options)
    assert get_policy(name, **from_dict.rock_policy_kwargs).config == config
    assert policy_class(config=config).config == policy_class(**options).config == config


def test_bad_option_values_fail_when_the_training_config_is_made(tmp_path):
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 1, got 0"):
        make_args(tmp_path, rock_policy="rock_online", rock_policy_kwargs='{"top_k": 0}')
    with pytest.raises(ValueError, match=r"token_ids is required by the rock_freeze policy"):
        make_args(tmp_path, rock_policy="rock_freeze")
    with pytest.raises(ValueError, match=r"rock_policy 'entropy' does not take 'quantile'.*keep_fraction, weight"):
        make_args(tmp_path, rock_policy="entropy", rock_policy_kwargs={"quantile": 0.5})


def test_options_are_checked_once_per_policy(monkeypatch):
    calls = []
    check = RockOnlineConfig.__post_init__
    monkeypatch.setattr(RockOnlineConfig, "__post_init__", lambda self: (calls.append(1), check(self))[1])
    get_policy("rock_online", top_k=3)
    assert len(calls) == 1
    RockOnlinePolicy(top_k=3)
    assert len(calls) == 2
    RockOnlinePolicy(config=RockOnlineConfig(top_k=3))
    assert len(calls) == 3


def test_constructors_take_a_config_or_keywords_not_both():
    assert RockOnlinePolicy(config=RockOnlineConfig(top_k=7)).top_k == 7
    assert RockOnlinePolicy(top_k=7).config == RockOnlineConfig(top_k=7)
    p = RockFreezePolicy(config=RockFreezeConfig(token_ids=[3], weight=0.25))
    assert (p.token_ids, p.weight) == ([3], 0.25)
    assert RockFreezePolicy([3], 0.25).config == p.config  # positional, as subclasses call it
    with pytest.raises(TypeError, match="either as config= or as keyword arguments.*top_k"):
        RockOnlinePolicy(top_k=5, config=RockOnlineConfig())
    with pytest.raises(TypeError, match="config must be a EntropyConfig, got LossQuantileConfig"):
        EntropyPolicy(config=LossQuantileConfig())
    with pytest.raises(ValueError, match="token_ids is required"):
        RockFreezePolicy()


def test_third_party_policies_without_a_config_keep_the_signature_check():
    @register_policy("no_config_test")
    class NoConfig(TokenPolicy):
        def __init__(self, factor=0.5):
            self.factor = factor

        def weights(self, batch):
            return batch.mask.float() * self.factor

    assert policy_config_class("no_config_test") is None
    assert build_policy_options("no_config_test", '{"factor": 0.25}') == {"factor": 0.25}
    assert get_policy("no_config_test", factor=0.25).factor == 0.25
    with pytest.raises(ValueError, match=r"'no_config_test' does not take 'fator'.*factor"):
        build_policy_options("no_config_test", {"fator": 1})


def test_subclasses_get_the_options_of_the_constructor_they_run():
    @register_policy("inherits_online_test")
    class Inherits(RockOnlinePolicy):
        needs_entropy = True

    @register_policy("own_init_test")
    class OwnInit(RockFreezePolicy):
        def __init__(self, token_ids, weight=0.5):
            super().__init__(token_ids, weight)

    assert policy_config_class("inherits_online_test") is RockOnlineConfig
    assert isinstance(get_policy("inherits_online_test", top_k=4), Inherits)
    with pytest.raises(ValueError, match="top_k must be an integer >= 1"):
        get_policy("inherits_online_test", top_k=0)
    assert policy_config_class("own_init_test") is None
    assert get_policy("own_init_test", token_ids=[2]).weight == 0.5


def test_third_party_policies_may_declare_a_config():
    @dataclasses.dataclass
    class ScaleConfig(PolicyConfig):
        factor: float = dataclasses.field(default=1.0, metadata={"help": "Weight of every valid token."})

        def __post_init__(self):
            if self.factor <= 0:
                raise ValueError(f"factor must be > 0, got {self.factor}.")

    @register_policy("scale_test")
    class Scale(TokenPolicy):
        config_class = ScaleConfig

        def __init__(self, factor=1.0, *, config=None):
            self.factor = (config or ScaleConfig(factor)).factor

        def weights(self, batch):
            return batch.mask.float() * self.factor

    assert get_policy("scale_test", factor=2.0).factor == 2.0
    with pytest.raises(ValueError, match="factor must be > 0, got -1"):
        get_policy("scale_test", factor=-1)


@pytest.mark.parametrize(
    "config_class, argv, expected",
    [
        (RockOnlineConfig, ["--top_k", "7", "--ema_decay", "0.9"], {"top_k": 7, "ema_decay": 0.9, "weight": 0.0}),
        (RockFreezeConfig, ["--token_ids", "r.json", "--weight", "0.5"], {"token_ids": "r.json", "weight": 0.5}),
        (RandomMatchedConfig, ["--rock_set", "rocks.json", "--seed", "3"], {"rock_set": "rocks.json", "seed": 3}),
        (LossQuantileConfig, ["--quantile", "0.8"], {"quantile": 0.8}),
        (EntropyConfig, ["--keep_fraction", "0.3"], {"keep_fraction": 0.3}),
        (UniformConfig, [], {}),
    ],
)
def test_options_parse_as_command_line_flags(config_class, argv, expected):
    (config,) = HfArgumentParser(config_class).parse_args_into_dataclasses(argv)
    assert isinstance(config, config_class)
    for key, value in expected.items():
        assert getattr(config, key) == value
    with pytest.raises(ValueError, match="not used by the HfArgumentParser"):
        HfArgumentParser(config_class).parse_args_into_dataclasses([*argv, "--not_an_option", "1"])


def test_policy_config_is_independent_of_later_setup():
    p = RockFreezePolicy(token_ids=[7, 1])
    p.setup(vocab_size=10)
    p.weights(TokenBatch(torch.tensor([[7, 2]]), torch.ones(1, 2, dtype=torch.bool), 0))
    assert p.config.token_ids == [7, 1] and p.rock_ids() == [7, 1]
