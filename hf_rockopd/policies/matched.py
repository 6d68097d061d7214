"""`random_matched`: the control of a rock set, a random id set with the same frequency distribution."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers.utils import logging

from .rock_set import NotEnoughControlIdsError, frequency_matched_ids, load_rock_set, validate_token_ids
from .base import TokenBatch, TokenPolicy, _expand_ids_mask, _set_weights, register_policy
from .configs import RandomMatchedConfig, resolve_config
from .statistics import TokenStatistics


logger = logging.get_logger(__name__)


__all__ = ["RandomMatchedPolicy"]


@register_policy("random_matched")
class RandomMatchedPolicy(TokenPolicy):
    """Control for a rock set: freeze a random id set with the *same frequency distribution* as the rocks.

    If `reference_counts` is given, the control is drawn at setup from those counts. Otherwise the policy counts the
    completion tokens of the first `warmup_steps` steps (weights stay 1 meanwhile) and draws then, from the student's
    own token frequencies. Matching is by quantile bins of log-frequency (see `frequency_matched_ids`).

    Args:
        rock_set (`list[int]` or `str`): the rock ids, or a rock-set JSON file.
        reference_counts (`dict[int, int]` or `str`, *optional*): token frequencies to match on (a dict, or a JSON
            file with an object of id → count, at top level or under `"counts"`).
        warmup_steps (`int`, defaults to 20): steps counted before drawing, when `reference_counts` is None.
        num_bins (`int`, defaults to 10): frequency bins.
        seed (`int`, defaults to 0): seed of the draw (same on every process).
        weight (`float`, defaults to 0.0): weight of the control ids.
        config ([`RandomMatchedConfig`], *optional*): the options as one checked object, instead of the keywords.

    Example:
    ```python
    >>> from hf_rockopd.policies import RandomMatchedPolicy
    >>> counts = {0: 1000, 1: 990, 2: 5, 3: 4, 4: 3, 5: 2}  # id 1 is the only other id in the top third
    >>> p = RandomMatchedPolicy(rock_set=[0], reference_counts=counts, num_bins=3); p.setup(vocab_size=6)
    >>> p.rock_ids()
    [1]
    ```
    """

    config_class = RandomMatchedConfig

    def __init__(
        self,
        rock_set: Sequence[int] | str | os.PathLike | None = None,
        reference_counts: Mapping[int, int] | str | os.PathLike | None = RandomMatchedConfig.reference_counts,
        warmup_steps: int = RandomMatchedConfig.warmup_steps,
        num_bins: int = RandomMatchedConfig.num_bins,
        seed: int = RandomMatchedConfig.seed,
        weight: float = RandomMatchedConfig.weight,
        *,
        config: RandomMatchedConfig | None = None,
    ):
        self.config = resolve_config(
            RandomMatchedConfig, config, rock_set=rock_set, reference_counts=reference_counts,
            warmup_steps=warmup_steps, num_bins=num_bins, seed=seed, weight=weight,
        )  # fmt: skip
        self.rock_source = self.config.rock_set
        self.reference_counts = self.config.reference_counts
        self.warmup_steps = self.config.warmup_steps
        self.num_bins = self.config.num_bins
        self.seed = self.config.seed
        self.weight = self.config.weight
        self.vocab_size: int | None = None
        self._matched: list[int] | None = None

    def _load_reference(self) -> torch.Tensor:
        ref = self.reference_counts
        if isinstance(ref, (str, os.PathLike)):
            try:
                with open(ref, encoding="utf-8") as f:
                    ref = json.load(f)
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"reference_counts file {os.fspath(ref)!r} could not be read as JSON: {err}") from err
            ref = ref.get("counts", ref) if isinstance(ref, dict) else ref
        if not isinstance(ref, Mapping):
            raise ValueError("reference_counts must map token ids to counts.")
        counts = torch.zeros(self.vocab_size, dtype=torch.float64)
        for k, v in ref.items():
            i = int(k)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"reference_counts has id {i} outside the vocabulary [0, {self.vocab_size}).")
            counts[i] = float(v)
        return counts

    def setup(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)
        if isinstance(self.rock_source, (str, os.PathLike)):
            self.rock_token_ids = load_rock_set(self.rock_source, vocab_size=vocab_size)["token_ids"]
        else:
            self.rock_token_ids = validate_token_ids(self.rock_source, vocab_size, source="random_matched rock_set")
        self._counts = TokenStatistics(vocab_size)
        self._id_mask = torch.zeros(vocab_size, dtype=torch.bool)
        self._postponed_warning = False
        if self.reference_counts is not None:
            self._draw(self._load_reference())

    def _draw(self, counts: torch.Tensor) -> None:
        # The control never freezes a stop or control token either (as no selection does): it stands for the rocks.
        self._matched = frequency_matched_ids(
            self.rock_token_ids, counts, num_bins=self.num_bins, seed=self.seed,
            exclude_ids=[i for i in self.special_ids if i < self.vocab_size],
        )
        self._id_mask = _expand_ids_mask(self._matched, self.vocab_size)
        self._reference = counts

    def weights(self, batch: TokenBatch) -> torch.Tensor:
        if self.vocab_size is None:
            raise RuntimeError("RandomMatchedPolicy.setup(vocab_size) must be called before use (the trainer does it).")
        if self._matched is None and batch.training and batch.step >= self.warmup_steps:
            try:
                self._draw(self._counts.count.clone())
            except NotEnoughControlIdsError as err:
                # Too few non-rock ids seen yet to match every rock: keep counting (weights stay 1 meanwhile) and
                # draw at a later step, instead of stopping the training run.
                if not self._postponed_warning:
                    logger.warning(
                        f"random_matched: the control is not drawn yet after {batch.step} steps ({err}); it is drawn "
                        "once enough token ids are seen. Give `reference_counts` to draw it at the start."
                    )
                    self._postponed_warning = True
        return _set_weights(batch, self._id_mask, self.weight)

    def update(self, batch: TokenBatch, weights: torch.Tensor) -> None:
        if batch.training and self._matched is None:
            self._counts.data += TokenStatistics.from_batch(batch, self.vocab_size).data

    def rock_ids(self) -> list[int]:
        return list(self._matched or [])

    def metrics(self) -> dict[str, float]:
        out = {"set_size": float(len(self._matched or []))}
        if self._matched:
            # Two-sample KS distance between the log-frequencies of the rocks and of their control: near 0 = matched.
            from scipy.stats import ks_2samp

            ref = self._reference
            a = torch.log1p(ref[self.rock_token_ids]).numpy()
            b = torch.log1p(ref[self._matched]).numpy()
            out["match_ks"] = float(ks_2samp(a, b).statistic)
        return out

    def state_dict(self) -> dict[str, Any]:
        if self.vocab_size is None:
            return {}
        return {
            "counts": self._counts.data.clone(),
            "matched": None if self._matched is None else list(self._matched),
            "reference": None if self._matched is None else self._reference.clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self._counts = TokenStatistics(self.vocab_size, state["counts"].clone())
        if state["matched"] is not None:
            self._matched = [int(i) for i in state["matched"]]
            self._id_mask = _expand_ids_mask(self._matched, self.vocab_size)
            self._reference = state["reference"].clone()

