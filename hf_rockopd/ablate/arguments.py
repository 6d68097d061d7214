"""The options of `hf-rockopd ablate` ([`AblateArguments`]); the command parses them with the training config.

The budget of every run is the training config's: `--max_steps` steps per run, `--per_device_train_batch_size`,
`--learning_rate`, `--max_new_tokens` and so on, identical for every policy. What is ablation-specific (policies,
seeds, protocol, rock discovery, evaluation) is an [`AblateArguments`] field.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..distill import DEFAULT_TRAINING_ARGS as _DISTILL_TRAINING_ARGS

# The rest of the package, gathered here (see also runner.py): the training config and the policy registry.
from ..data.resolve import DEFAULT_CONFIGS
from ..data.arguments import DatasetArguments
from ..models.arguments import ModelPairArguments
from ..policies import available_policies, parse_policy_kwargs
from ..trainers import RockOPDConfig

# The policies of the paper's ablation, by the name a run directory and the summary use. `soft` is `rock_freeze` with
# the rocks weighted `soft_weight` (not 0) and `rock_normalization="tokens"`; any other registered policy name may be
# listed too (its options from `policy_kwargs`).
ABLATION_POLICIES = ("uniform", "rock_freeze", "random_matched", "rock_online", "soft")
# Policies that need a rock set found before the runs start (on the warm-start or base weights).
POLICIES_NEEDING_ROCKS = ("rock_freeze", "random_matched", "soft")
PROTOCOLS = ("warm_start", "from_scratch")

# Training settings of `hf-rockopd ablate` that differ from TRL's (a YAML `--config` or any flag overrides them).
DEFAULT_TRAINING_ARGS: dict[str, Any] = {
    **_DISTILL_TRAINING_ARGS,  # the distill job's budget, so an ablation reproduces its runs by default
    "output_dir": "runs/ablate",
    "rock_policy": "uniform",
}
# Training fields that define a run's budget and objective: an output directory made with other values is refused,
# since its finished runs would be skipped and compared with runs made under the new ones.
BUDGET_FIELDS = (
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_new_tokens",
    "max_length",
    "beta",
    "lmbda",
    "temperature",
    "loss_temperature",
    "rock_normalization",
    "rock_probe_fraction",
    "seq_kd",
)


@dataclass
class AblateArguments(ModelPairArguments, DatasetArguments):
    r"""
    Arguments of `hf-rockopd ablate` besides the training ones ([`~hf_rockopd.RockOPDConfig`]'s: `--output_dir` is the
    ablation's root directory and `--max_steps` the steps of every run); the model options are
    [`~hf_rockopd.models.arguments.ModelPairArguments`]'s, the data options
    [`~hf_rockopd.data.arguments.DatasetArguments`]'s.

    Example:
    ```python
    >>> from hf_rockopd.ablate.arguments import AblateArguments
    >>> a = AblateArguments(policies=["uniform", "soft"], seeds=[0, 1], protocol="from_scratch")
    >>> a.policies, a.seeds, a.soft_weight
    (['uniform', 'soft'], [0, 1], 0.3)
    ```
    """

    # > The design
    policies: list[str] = field(
        default_factory=lambda: list(ABLATION_POLICIES),
        metadata={"help": f"Policies compared ({', '.join(ABLATION_POLICIES)}, or any registered policy name)."},
    )
    seeds: list[int] = field(
        default_factory=lambda: [0, 1, 2],
        metadata={"help": "Seeds; each is the trainer's seed and data_seed of one run per policy."},
    )
    protocol: str = field(
        default="warm_start",
        metadata={
            "help": "'warm_start' (the paper's): uniform OPD for warm_start_steps, rocks found on that checkpoint, "
            "then every run continues from it; 'from_scratch': every run starts from the student, rocks found on it.",
            "choices": list(PROTOCOLS),
        },
    )
    warm_start_steps: int = field(default=20, metadata={"help": "Steps of uniform OPD before the runs (warm_start)."})
    warm_start_save_steps: int = field(
        default=10, metadata={"help": "Checkpoint interval of the warm start, so a killed one resumes (0: none)."}
    )
    # > Rocks (found with the lab's collect + score on the starting weights)
    rock_set: str | None = field(
        default=None, metadata={"help": "A rock-set JSON file to use instead of the one found on the start weights."}
    )
    rock_num_prompts: int = field(default=64, metadata={"help": "Training prompts rolled out to find rocks."})
    rock_max_new_tokens: int | None = field(
        default=None, metadata={"help": "New tokens per rollout when finding rocks (default: --max_new_tokens)."}
    )
    rock_top_k: int = field(default=50, metadata={"help": "Rocks selected (the lab's score --top_k)."})
    rock_min_count: int = field(default=2, metadata={"help": "Fewest occurrences of an eligible token type."})
    rock_exclude_top_frequent: int = field(default=5, metadata={"help": "Most frequent types never selected."})
    soft_weight: float = field(default=0.3, metadata={"help": "Weight of the rocks in the 'soft' policy."})
    policy_kwargs: str | None = field(
        default=None,
        metadata={"help": 'JSON object of per-policy options merged over the built-in ones, e.g. '
                  '\'{"rock_online": {"top_k": 20}}\'.'},
    )
    # > Data and evaluation
    verifier: str = field(
        default="math",
        metadata={"help": "How answers are checked (math-verify): math or gsm8k ('#### n' references).",
                  "choices": ["math", "gsm8k"]},
    )
    split_seed: int = field(default=42, metadata={"help": "Seed of the train / held-out split (one for every run)."})
    num_train_prompts: int = field(default=256, metadata={"help": "Training prompts (non-held-out rows)."})
    num_eval_problems: int = field(default=32, metadata={"help": "Held-out problems evaluated after every run."})
    eval_max_new_tokens: int = field(default=192, metadata={"help": "Greedy new tokens per evaluation problem."})
    eval_batch_size: int = field(default=16, metadata={"help": "Problems generated (and rollouts made) at once."})

    def __post_init__(self):
        for name in ("warm_start_steps", "rock_num_prompts", "rock_top_k", "rock_min_count", "num_train_prompts",
                     "num_eval_problems", "eval_max_new_tokens", "eval_batch_size"):
            _check_int(name, getattr(self, name), 1)
        for name in ("warm_start_save_steps", "rock_exclude_top_frequent"):
            _check_int(name, getattr(self, name), 0)
        for name in ("student_num_layers", "rock_max_new_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        super().__post_init__()
        if self.verifier not in ("math", "gsm8k"):
            raise ValueError(
                f"verifier must be 'math' or 'gsm8k' (the ablation compares accuracy), got {self.verifier!r}."
            )
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}.")
        if not math.isfinite(self.soft_weight) or not 0.0 < self.soft_weight < 1.0:
            raise ValueError(f"soft_weight must be in (0, 1) (0 is rock_freeze, 1 is uniform), got {self.soft_weight}.")
        if isinstance(self.policies, str):
            self.policies = [self.policies]
        if not self.policies:
            raise ValueError("policies is empty: list at least one, e.g. --policies uniform rock_freeze.")
        known = sorted(set(ABLATION_POLICIES) | set(available_policies()))
        unknown = [p for p in self.policies if p not in known]
        if unknown:
            raise ValueError(f"policies has unknown name(s) {unknown}; known: {', '.join(known)}.")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies lists a name twice: {self.policies}.")
        if isinstance(self.seeds, int):
            self.seeds = [self.seeds]
        if not self.seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be a non-empty list of integers >= 0, got {self.seeds!r}.")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds lists a seed twice: {self.seeds}.")
        self.parsed_policy_kwargs()  # a bad JSON object fails here, not after the models are loaded

    def parsed_policy_kwargs(self) -> dict[str, dict[str, Any]]:
        """`policy_kwargs` as `{policy name: {option: value}}` (a `ValueError` names what is wrong)."""
        value = parse_policy_kwargs(self.policy_kwargs, name="policy_kwargs")
        if not all(isinstance(v, dict) for v in value.values()):
            raise ValueError(f"policy_kwargs must be a JSON object of objects per policy name, got {value!r}.")
        extra = sorted(set(value) - set(self.policies))
        if extra:
            raise ValueError(f"policy_kwargs names {extra}, which are not in policies {self.policies}.")
        return {k: dict(v) for k, v in value.items()}

    def needs_rocks(self) -> bool:
        """Whether a rock set must exist before the runs (a listed policy freezes or matches rocks)."""
        return any(p in POLICIES_NEEDING_ROCKS for p in self.policies)

    def fingerprint(self) -> dict[str, Any]:
        """The settings a finished run depends on (not the policies and seeds, which a rerun may extend)."""
        values = asdict(self)
        for name in ("policies", "seeds", "warm_start_save_steps", "eval_batch_size"):
            values.pop(name)
        # Data options added later are left out at their defaults, so an ablation begun before them still resumes.
        values["dataset_config"] = values["dataset_config"] or DEFAULT_CONFIGS.get(self.dataset)
        for name, default in _LATER_DATA_DEFAULTS.items():
            if values[name] == default:
                values.pop(name)
        return values


_LATER_DATA_DEFAULTS = {
    "dataset_split": "train", "prompt_column": None, "answer_column": None, "eval_dataset": None,
    "eval_dataset_config": None, "eval_dataset_split": "test", "verifier": "math",
}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def check_training_budget(args: RockOPDConfig) -> None:
    """The budget is counted in optimizer steps: `max_steps` must be set (TRL's default -1 means "use epochs")."""
    if args.max_steps is None or args.max_steps < 1:
        raise ValueError(f"max_steps must be >= 1 (the steps of every run), got {args.max_steps}.")


def training_fingerprint(args: RockOPDConfig) -> dict[str, Any]:
    """The training config's values of `BUDGET_FIELDS`, JSON-ready."""
    return {name: json.loads(json.dumps(getattr(args, name, None), default=str)) for name in BUDGET_FIELDS}
