"""Loss-path benchmark: forward + backward from the last hidden states to the scalar loss, ours against TRL's two paths.

Three implementations run on identical inputs (`(B·L, H)` student and teacher hidden states, two `(V, H)` output heads,
the student's head trainable, a 0/1 weight per position with the frozen fraction at 0):

- `rockopd`: `hf_rockopd.losses.chunked_weighted_loss` on the weighted rows, normalized by the number
  of valid tokens, exactly as the engine calls it (`hf_rockopd.engine.weighting.project_rows`);
- `gkd`: full `(B, L, V)` logits of both heads, then `GKDTrainer.generalized_jsd_loss` with frozen positions' labels at
  `-100` and `num_items_in_batch` the valid-token count (GKDTrainer has no token weights; masking is the same loss for
  0/1 weights);
- `distillation`: the chunked divergence of TRL's `DistillationTrainer` (`trl.trainer.distillation_trainer.
  _chunked_divergence_loss`, which its `_compute_loss` calls), with frozen positions out of the completion mask.

With frozen positions, `rockopd_uniform` (ours with every weight 1) is timed in the same process, so "frozen vs our own
uniform time" is a paired comparison too. With `--divergence-path`, `rockopd_divergence` is timed beside them: our
`hf_rockopd.losses.chunked_divergence` (per-row divergences that stay differentiable), then the weighted sum, the path
`RockOPDTrainer` takes for policies that weight tokens by this step's divergence or entropy (`loss_quantile`,
`entropy`). It must agree with ours like an anchor, and its float64 distance must be within the tolerance too.

Each case runs in fresh subprocesses: one per implementation for peak memory (RSS high-water mark since a reset,
minus the RSS at the reset, see `benchmarks.memory`), then one for time, where the implementations are interleaved
(rotated order) over the repeats and the median is reported. The agreement of the loss and of both gradients with
ours is checked on every case; a difference above the tolerance fails the run loudly.

Run: `python -m benchmarks.loss_path --out benchmarks/results/loss_path.json` (see `--help` for the grid).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch


__all__ = [
    "AgreementError",
    "IMPLEMENTATIONS",
    "LossCase",
    "check_agreement",
    "make_inputs",
    "run_case",
    "run_once",
]

IMPLEMENTATIONS = ("rockopd", "gkd", "distillation")
# Our second loss path (weights decided from the divergence), benchmarked with `--divergence-path`.
DIVERGENCE_PATH = "rockopd_divergence"
GIB = 1024**3
# Relative tolerances of the agreement check (loss, and gradient in L2 norm) against ours.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


class AgreementError(AssertionError):
    """An implementation's loss or gradient differs from ours beyond the tolerance."""


@dataclass(frozen=True)
class LossCase:
    """One benchmark case.

    Parameters:
        hidden (`int`): hidden width H of both models.
        vocab (`int`): vocabulary size V.
        batch (`int`): sequences B.
        length (`int`): completion length L (every position valid).
        beta (`float`): generalized-JSD beta (0 forward KL, 1 reverse KL).
        frozen (`float`): fraction of positions with weight 0, drawn at random.
        seed (`int`): seed of the inputs.
        chunk_size (`int`): our `loss_chunk_size` (rows projected at once).
        teacher_hidden (`int`, *optional*): the teacher's hidden width, when it differs from the student's (a
            Qwen3-8B teacher, H = 4096, over a Qwen3-1.7B student, H = 2048); only the vocabulary must match.

    Example:
    ```python
    >>> from benchmarks.loss_path import LossCase
    >>> LossCase(hidden=8, vocab=16, batch=2, length=4, beta=1.0, frozen=0.5).rows
    8
    ```
    """

    hidden: int
    vocab: int
    batch: int
    length: int
    beta: float
    frozen: float
    seed: int = 0
    chunk_size: int = 512
    teacher_hidden: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden", "vocab", "batch", "length", "chunk_size", "teacher_hidden"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}.")
        if not 0.0 <= self.frozen < 1.0:
            raise ValueError(f"frozen must be in [0, 1), got {self.frozen}.")

    @property
    def hidden_t(self) -> int:
        """The teacher's hidden width."""
        return self.teacher_hidden or self.hidden

    @property
    def rows(self) -> int:
        return self.batch * self.length

    @property
    def logits_bytes(self) -> int:
        """Bytes of one float32 `(B, L, V)` logits tensor."""
        return 4 * self.rows * self.vocab


def make_inputs(case: LossCase, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Hidden states, heads and weights of `case`, seeded, drawn on `device` and cast to `dtype`; logits have a spread
    like a trained LM's (std ~3). The same seed gives other numbers on another device (its own generator)."""
    gen = torch.Generator(device=device).manual_seed(case.seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    h_s = randn(case.rows, case.hidden).to(dtype).requires_grad_(True)
    h_t = randn(case.rows, case.hidden_t).to(dtype)
    scale = 3.0 / math.sqrt(case.hidden)
    head_s = torch.nn.Linear(case.hidden, case.vocab, bias=False, device=device, dtype=dtype)
    head_t = torch.nn.Linear(case.hidden_t, case.vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head_s.weight.copy_(randn(case.vocab, case.hidden) * scale)
        # The teacher is a perturbed student, so the divergence is of a realistic size (not two unrelated models).
        # A wider teacher's extra inputs get weights of the same spread as the perturbation.
        common = min(case.hidden, case.hidden_t)
        head_t.weight[:, :common].copy_(head_s.weight[:, :common].float() + 0.5 * scale * randn(case.vocab, common))
        if case.hidden_t > common:
            head_t.weight[:, common:].copy_(0.5 * scale * randn(case.vocab, case.hidden_t - common))
    head_t.requires_grad_(False)
    weights = (torch.rand(case.batch, case.length, generator=gen, device=device) >= case.frozen).float()
    return {"h_s": h_s, "h_t": h_t, "head_s": head_s, "head_t": head_t, "weights": weights}


def _rockopd_loss(inputs: dict, case: LossCase, uniform: bool = False, compile: bool | None = None) -> torch.Tensor:
    from hf_rockopd.losses import chunked_weighted_loss

    weights = torch.ones_like(inputs["weights"]) if uniform else inputs["weights"]
    grad_rows = (weights > 0).reshape(-1)
    loss, _ = chunked_weighted_loss(
        inputs["h_s"][grad_rows],
        inputs["h_t"][grad_rows],
        inputs["head_s"],
        inputs["head_t"],
        weights.reshape(-1)[grad_rows],
        normalizer=float(case.rows),
        beta=case.beta,
        temperature=1.0,
        chunk_size=case.chunk_size,
        compile=compile,
    )
    return loss


def _rockopd_divergence_loss(inputs: dict, case: LossCase) -> torch.Tensor:
    from hf_rockopd.losses import chunked_divergence

    grad_rows = (inputs["weights"] > 0).reshape(-1)
    out = chunked_divergence(
        inputs["h_s"][grad_rows],
        inputs["h_t"][grad_rows],
        inputs["head_s"],
        inputs["head_t"],
        beta=case.beta,
        temperature=1.0,
        chunk_size=case.chunk_size,
    )
    return (out.divergence * inputs["weights"].reshape(-1)[grad_rows]).sum() / case.rows


def _gkd_loss(inputs: dict, case: LossCase) -> torch.Tensor:
    from trl.experimental.gkd import GKDTrainer

    shape = (case.batch, case.length, case.vocab)
    student_logits = inputs["head_s"](inputs["h_s"]).view(shape)
    with torch.no_grad():
        teacher_logits = inputs["head_t"](inputs["h_t"]).view(shape)
    labels = torch.zeros_like(inputs["weights"], dtype=torch.long).masked_fill(inputs["weights"] == 0, -100)
    n_valid = torch.tensor(float(case.rows), device=labels.device)
    return GKDTrainer.generalized_jsd_loss(
        student_logits, teacher_logits, labels=labels, beta=case.beta, temperature=1.0, num_items_in_batch=n_valid
    )


def _distillation_loss(inputs: dict, case: LossCase) -> torch.Tensor:
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    loss, _, _ = _chunked_divergence_loss(
        inputs["h_s"].view(case.batch, case.length, case.hidden),
        inputs["h_t"].view(case.batch, case.length, case.hidden_t),
        inputs["head_s"].weight,
        inputs["head_t"].weight,
        completion_mask=(inputs["weights"] > 0).long(),
        beta=case.beta,
        num_items_in_batch=torch.tensor(float(case.rows), device=inputs["h_s"].device),
        temperature=1.0,
    )
    return loss


def _rockopd_eager_loss(inputs: dict, case: LossCase) -> torch.Tensor:
    """Ours with the chunk's closed forms left uncompiled (they are compiled on CUDA by default)."""
    return _rockopd_loss(inputs, case, compile=False)


_LOSSES = {
    "rockopd": _rockopd_loss,
    "rockopd_eager": _rockopd_eager_loss,
    "rockopd_uniform": lambda inputs, case: _rockopd_loss(inputs, case, uniform=True),
    DIVERGENCE_PATH: _rockopd_divergence_loss,
    "gkd": _gkd_loss,
    "distillation": _distillation_loss,
}


def run_once(impl: str, inputs: dict, case: LossCase) -> dict:
    """One forward + backward of `impl`; returns the loss and the gradients of the student hidden states and head."""
    if impl not in _LOSSES:
        raise ValueError(f"Unknown implementation {impl!r}; choose from {sorted(_LOSSES)}.")
    inputs["h_s"].grad = None
    inputs["head_s"].weight.grad = None
    loss = _LOSSES[impl](inputs, case)
    loss.backward()
    return {"loss": loss.detach(), "grad_h": inputs["h_s"].grad, "grad_w": inputs["head_s"].weight.grad}


_REL_BLOCK = 2**22  # entries per float64 block: a (V, H) head gradient in float64 is 2.5 GB at the Qwen3 head


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """`‖a − b‖ / ‖b‖` in float64, a block at a time, so that comparing head gradients adds no head-sized copy."""
    a, b = a.reshape(-1), b.reshape(-1)
    diff = ref = 0.0
    for start in range(0, b.numel(), _REL_BLOCK):
        a_blk, b_blk = a[start : start + _REL_BLOCK].double(), b[start : start + _REL_BLOCK].double()
        diff += float((a_blk - b_blk).square().sum())
        ref += float(b_blk.square().sum())
    return math.sqrt(diff) / max(math.sqrt(ref), 1e-30)


def relative_differences(result: dict, reference: dict) -> dict:
    """Relative L2 differences of the loss and of both gradients of `result` to `reference`."""
    return {
        "loss_rel": _rel(result["loss"], reference["loss"]),
        "grad_h_rel": _rel(result["grad_h"], reference["grad_h"]),
        "grad_w_rel": _rel(result["grad_w"], reference["grad_w"]),
    }


def _over_tolerance(diffs: dict) -> dict:
    return {k: v for k, v in diffs.items() if not v <= (LOSS_RTOL if k == "loss_rel" else GRAD_RTOL)}


def check_agreement(result: dict, reference: dict, impl: str, against: str = "rockopd") -> dict:
    """Relative differences of `result` to the `reference` (ours); raise [`AgreementError`] above the tolerances."""
    diffs = relative_differences(result, reference)
    bad = _over_tolerance(diffs)
    if bad:
        raise AgreementError(
            f"{impl} disagrees with {against}: {bad} (tolerances: loss {LOSS_RTOL}, gradients {GRAD_RTOL}); "
            f"loss {float(result['loss'])!r} vs {float(reference['loss'])!r}."
        )
    return diffs


def reference_float64(inputs: dict, case: LossCase, rows_per_chunk: int = 256, vocab_block: int = 16384) -> dict:
    """The weighted loss and its gradients in float64, from the definition (log-softmax, KL, mixture) and autograd,
    chunk by chunk: the referee when a float32 anchor and ours differ by more than the tolerance.

    Autograd goes from the loss to each chunk's float64 logits; the head's chain rule (`g W`, `gᵀ h`) is applied by
    hand, a vocabulary block at a time, so no float64 copy of a head exists: at the Qwen3 head (V = 151,936,
    H = 2048) one is 2.5 GB, and three of them broke the timing process's memory cap."""
    h_s, h_t = inputs["h_s"].detach(), inputs["h_t"].detach()
    w_s, w_t = inputs["head_s"].weight.detach(), inputs["head_t"].weight.detach()
    weights = inputs["weights"].reshape(-1).double()
    beta, vocab = case.beta, w_s.shape[0]
    blocks = [slice(v, v + vocab_block) for v in range(0, vocab, vocab_block)]

    def project(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = h.double()
        return torch.cat([h @ w[blk].double().T for blk in blocks], dim=1)

    loss = torch.zeros((), dtype=torch.float64, device=h_s.device)
    grad_h = torch.zeros(h_s.shape, dtype=torch.float64, device=h_s.device)
    grad_w = torch.zeros(w_s.shape, dtype=torch.float64, device=h_s.device)
    for start in range(0, case.rows, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        z_s = project(h_s[rows], w_s).requires_grad_(True)
        ls = torch.log_softmax(z_s, dim=-1)
        lt = torch.log_softmax(project(h_t[rows], w_t), dim=-1)
        if beta == 0.0:
            div = (lt.exp() * (lt - ls)).sum(-1)
        elif beta == 1.0:
            div = (ls.exp() * (ls - lt)).sum(-1)
        else:
            lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
            div = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
        part = (div * weights[rows]).sum() / case.rows
        (g,) = torch.autograd.grad(part, z_s)
        del ls, lt, div
        h = h_s[rows].double()
        for blk in blocks:
            grad_h[rows] += g[:, blk] @ w_s[blk].double()
            grad_w[blk] += g[:, blk].T @ h
        loss += part.detach()
    return {"loss": loss, "grad_h": grad_h, "grad_w": grad_w}


# ----------------------------------------------------------------------------------------------------- workers ----
def _worker_memory(case: LossCase, impl: str, budget: int) -> dict:
    from benchmarks.memory import cap_address_space, peak_rss_since_reset, reset_peak_rss

    # Warm up the same code path on a small batch: thread pools and one-time buffers are not the loss path's memory.
    small = LossCase(**{**asdict(case), "batch": 1, "length": min(case.length, 16)})
    run_once(impl, make_inputs(small), small)
    inputs = make_inputs(case)
    cap_address_space(budget)
    baseline = reset_peak_rss()
    try:
        run_once(impl, inputs, case)
    except (RuntimeError, MemoryError) as err:
        if "alloc" not in str(err).lower() and not isinstance(err, MemoryError):
            raise
        return {"status": "OOM", "reason": f"over the {budget / GIB:.1f} GiB cap: {str(err)[:160]}"}
    return {"status": "ok", "peak_bytes": peak_rss_since_reset() - baseline, "baseline_bytes": baseline}


def _worker_time(case: LossCase, impls: list[str], repeats: int, budget: int) -> dict:
    from benchmarks.memory import cap_address_space

    inputs = make_inputs(case)
    cap_address_space(budget)
    # Warm-up round, also the agreement check (the first implementation is ours). Only ours and the one being compared
    # are held at a time: at the Qwen3 head each result carries a 1.2 GiB head gradient.
    if impls[0] != "rockopd":
        raise ValueError(f"The timing run compares with ours, so it must come first; got {impls}.")
    ours = _detached(run_once("rockopd", inputs, case))
    loss = ours["loss"]
    anchors = [impl for impl in impls if impl in ("gkd", "distillation", DIVERGENCE_PATH)]
    agreement = {}
    for impl in impls[1:]:
        result = run_once(impl, inputs, case)
        if impl in anchors:
            agreement[impl] = relative_differences(result, ours)
        del result
    referee = {}
    if any(_over_tolerance(d) for d in agreement.values()):
        # An anchor and ours differ by more than the tolerance: float64 decides which one is off. Ours must be within
        # the tolerance of it (else the run fails); an anchor that is not is reported (and printed), not excused.
        # Each implementation is run again for the comparison (they are deterministic) rather than held.
        exact = reference_float64(inputs, case)
        referee["rockopd"] = relative_differences(ours, exact)
        check_agreement(ours, exact, "rockopd", against="the float64 reference")
        ours = None  # GKD's run below needs the room
        for impl in anchors:
            referee[impl] = relative_differences(run_once(impl, inputs, case), exact)
        if DIVERGENCE_PATH in anchors and _over_tolerance(referee[DIVERGENCE_PATH]):
            raise AgreementError(
                f"{DIVERGENCE_PATH} disagrees with the float64 reference: {_over_tolerance(referee[DIVERGENCE_PATH])}"
            )
        for impl in anchors:
            if _over_tolerance(agreement[impl]):
                print(
                    f"ANCHOR OFF: {impl} differs from ours by {agreement[impl]} on {case}; against float64, "
                    f"{impl} {referee[impl]}, ours {referee['rockopd']}",
                    file=sys.stderr,
                )
        exact = None
    ours = None
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(repeats):
        order = impls[r % len(impls) :] + impls[: r % len(impls)]
        for impl in order:
            start = time.perf_counter()
            run_once(impl, inputs, case)
            times[impl].append(time.perf_counter() - start)
    return {"times": times, "agreement": agreement, "referee": referee, "loss": float(loss)}


def _detached(result: dict) -> dict:
    """A copy of `run_once`'s result that the next run does not overwrite."""
    return {k: v.detach().clone() for k, v in result.items()}


def _spawn(mode: str, payload: dict, timeout: float) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "benchmarks.loss_path", "--worker", mode, json.dumps(payload)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"no result within {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        if proc.returncode < 0 or "MemoryError" in proc.stderr or "alloc" in proc.stderr.lower():
            return {"status": "OOM", "reason": f"worker died (rc {proc.returncode}): {' | '.join(tail)[:200]}"}
        if "AgreementError" in proc.stderr:
            raise AgreementError(" | ".join(tail))
        raise RuntimeError(f"benchmark worker failed (rc {proc.returncode}): {' | '.join(tail)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass
class _Calibration:
    """GKD's measured peak memory per float32 (B, L, V) logits tensor, per beta kind, to predict larger cases."""

    factors: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def key(case: LossCase) -> str:
        return "mixture" if 0 < case.beta < 1 else "kl"

    def predict(self, case: LossCase) -> float | None:
        factor = self.factors.get(self.key(case))
        return None if factor is None else factor * case.logits_bytes

    def update(self, case: LossCase, peak: int) -> None:
        self.factors[self.key(case)] = max(self.factors.get(self.key(case), 0.0), peak / case.logits_bytes)


def run_case(
    case: LossCase,
    repeats: int = 5,
    budget: int = 12 * GIB,
    calibration: _Calibration | None = None,
    timeout: float = 1800,
    measure_time: bool = True,
    divergence_path: bool = False,
) -> dict:
    """Memory of every implementation (fresh process each), then paired, interleaved times; one JSON-able record.

    Example:
    ```python
    >>> from benchmarks.loss_path import LossCase, run_case
    >>> rec = run_case(LossCase(hidden=16, vocab=64, batch=2, length=8, beta=1.0, frozen=0.0), repeats=1)
    >>> rec["status"]["gkd"]
    'ok'
    ```
    """
    calibration = calibration or _Calibration()
    impls = list(IMPLEMENTATIONS) + (["rockopd_uniform"] if case.frozen > 0 else [])
    impls += [DIVERGENCE_PATH] if divergence_path else []
    record: dict = {"case": asdict(case), "status": {}, "peak_bytes": {}, "reason": {}}
    for impl in impls:
        predicted = calibration.predict(case) if impl == "gkd" else None
        if predicted is not None and predicted > budget:
            record["status"][impl] = "OOM"
            record["reason"][impl] = (
                f"predicted {predicted / GIB:.1f} GiB (measured {calibration.factors[calibration.key(case)]:.2f} "
                f"x B*L*V*4 bytes) > {budget / GIB:.1f} GiB cap; not run"
            )
            continue
        out = _spawn("memory", {"case": asdict(case), "impl": impl, "budget": budget}, timeout)
        record["status"][impl] = out["status"]
        if out["status"] == "ok":
            record["peak_bytes"][impl] = out["peak_bytes"]
            if impl == "gkd":
                calibration.update(case, out["peak_bytes"])
        else:
            record["reason"][impl] = out["reason"]
    runnable = [impl for impl in impls if record["status"][impl] == "ok"]
    if "rockopd" not in runnable:
        raise RuntimeError(f"Our own loss path did not run on {case}: {record['reason'].get('rockopd')}")
    if measure_time:
        out = _spawn("time", {"case": asdict(case), "impls": runnable, "budget": budget, "repeats": repeats}, timeout)
        if out.get("status") == "OOM" and "gkd" in runnable:
            # The timing process holds the inputs, our result and one anchor's at once, more than any memory run: time
            # the others without GKD (the largest) rather than lose the case. The table shows GKD's time as OOM.
            record["time_status"] = {"gkd": "OOM"}
            record["reason"]["gkd_time"] = out["reason"]
            runnable = [impl for impl in runnable if impl != "gkd"]
            print(f"GKD's timing run of {case} ran out of memory; timing the others without it", file=sys.stderr)
            out = _spawn("time", {"case": asdict(case), "impls": runnable, "budget": budget, "repeats": repeats}, timeout)
        if out.get("status") in ("OOM", "timeout"):
            raise RuntimeError(f"The timing run of {case} failed after its memory runs passed: {out['reason']}")
        record["times"] = out["times"]
        record["median_s"] = {impl: statistics.median(t) for impl, t in out["times"].items()}
        record["agreement"] = out["agreement"]
        record["referee"] = out["referee"]
        record["loss"] = out["loss"]
    return record


def ratios(record: dict) -> dict:
    """Ours over each anchor (time and memory), frozen over our own uniform time, and our divergence path over our
    fused loss, from one record. A ratio over a zero (a tiny case's memory can stay under the RSS resolution) is left
    out."""
    out = {}
    med, mem = record.get("median_s", {}), record["peak_bytes"]

    def put(key: str, values: dict, num: str, den: str) -> None:
        if num in values and values.get(den):
            out[key] = values[num] / values[den]

    put("divergence_path_vs_fused_time", med, DIVERGENCE_PATH, "rockopd")
    put("divergence_path_vs_fused_mem", mem, DIVERGENCE_PATH, "rockopd")
    for anchor in ("gkd", "distillation"):
        put(f"time_vs_{anchor}", med, "rockopd", anchor)
        put(f"mem_vs_{anchor}", mem, "rockopd", anchor)
    put("time_vs_own_uniform", med, "rockopd", "rockopd_uniform")
    return out


def grid(full: bool) -> list[tuple[LossCase, bool]]:
    """`(case, timed)` pairs: the full 72-case grid with `full`, else the reduced default that fits a shared 2-core
    machine (see BENCHMARKS.md); untimed cases measure memory only (the scaling points)."""
    if full:
        return [
            (LossCase(hidden, vocab, 4, length, beta, frozen), True)
            for hidden, vocab in ((576, 49152), (2048, 151936))
            for length in (256, 512, 1024, 2048)
            for beta in (0.0, 0.5, 1.0)
            for frozen in (0.0, 0.2, 0.5)
        ]
    timed = [LossCase(576, 49152, 4, 256, beta, 0.0) for beta in (0.0, 0.5, 1.0)]
    timed += [LossCase(576, 49152, 4, 256, 1.0, frozen) for frozen in (0.2, 0.5)]
    timed += [LossCase(576, 49152, 4, length, 1.0, frozen) for length in (512, 1024) for frozen in (0.0, 0.5)]
    memory_only = [LossCase(576, 49152, 4, 2048, 1.0, 0.0), LossCase(2048, 151936, 4, 256, 1.0, 0.0)]
    return [(c, True) for c in timed] + [(c, False) for c in memory_only]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/loss_path.json", help="JSON file of the raw results")
    parser.add_argument("--full", action="store_true", help="the full 72-case grid (hours on 2 CPU cores)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per implementation (after a warm-up)")
    parser.add_argument("--budget-gib", type=float, default=12.0, help="memory cap per case and implementation")
    parser.add_argument("--limit", type=int, default=None, help="run only the first N cases of the grid")
    parser.add_argument(
        "--divergence-path",
        action="store_true",
        help="also time our chunked_divergence path (the loss_quantile and entropy policies' loss)",
    )
    parser.add_argument(
        "--case",
        action="append",
        default=None,
        metavar="H,V,B,L,BETA,FROZEN[,CHUNK][,memory]",
        help="run these cases instead of the grid (repeatable); CHUNK is our loss_chunk_size (default 512); a "
        "trailing ',memory' measures memory only",
    )
    args = parser.parse_args(argv)
    if args.worker:
        mode, payload = args.worker[0], json.loads(args.worker[1])
        case = LossCase(**payload["case"])
        if mode == "memory":
            out = _worker_memory(case, payload["impl"], int(payload["budget"]))
        else:
            out = _worker_time(case, payload["impls"], int(payload["repeats"]), int(payload["budget"]))
        print(json.dumps(out))
        return 0
    if args.repeats < 5:
        print(f"note: --repeats {args.repeats} is below the 5 the benchmark is specified with", file=sys.stderr)
    cases = grid(args.full)[: args.limit] if not args.case else [_parse_case(spec) for spec in args.case]
    calibration = _Calibration()
    records = []
    failures = []
    for i, (case, timed) in enumerate(sorted(cases, key=lambda c: (c[0].vocab, c[0].length))):
        try:
            record = run_case(
                case,
                args.repeats,
                int(args.budget_gib * GIB),
                calibration,
                measure_time=timed,
                divergence_path=args.divergence_path,
            )
        except AgreementError as err:
            failures.append(str(err))
            record = {"case": asdict(case), "agreement_error": str(err)}
        record["ratios"] = ratios(record) if "peak_bytes" in record else {}
        records.append(record)
        print(f"[{i + 1}/{len(cases)}] {_summary(record)}", flush=True)
        _write(args.out, records, args)
    if failures:
        print("AGREEMENT FAILED:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


def _parse_case(spec: str) -> tuple[LossCase, bool]:
    """`H,V,B,L,BETA,FROZEN[,CHUNK][,memory]` -> `(case, timed)`.

    Example:
    ```python
    >>> from benchmarks.loss_path import _parse_case
    >>> case, timed = _parse_case("2048,151936,4,256,1.0,0.0,256,memory")
    >>> case.chunk_size, timed
    (256, False)
    ```
    """
    parts = spec.split(",")
    timed = parts[-1] != "memory"
    nums = parts if timed else parts[:-1]
    if len(nums) not in (6, 7):
        raise SystemExit(f"--case wants H,V,B,L,BETA,FROZEN[,CHUNK][,memory], got {spec!r}.")
    try:
        h, v, b, length = (int(x) for x in nums[:4])
        chunk = int(nums[6]) if len(nums) == 7 else 512
        case = LossCase(h, v, b, length, float(nums[4]), float(nums[5]), chunk_size=chunk)
    except ValueError as err:
        raise SystemExit(f"--case {spec!r}: {err} (want H,V,B,L,BETA,FROZEN[,CHUNK][,memory]).") from None
    return case, timed


def _summary(record: dict) -> str:
    c = record["case"]
    head = f"H={c['hidden']} V={c['vocab']} L={c['length']} beta={c['beta']} frozen={c['frozen']} chunk={c['chunk_size']}"
    if "agreement_error" in record:
        return f"{head}: AGREEMENT ERROR {record['agreement_error']}"
    parts = []
    for impl, status in record["status"].items():
        if status != "ok":
            parts.append(f"{impl} {status}")
            continue
        t = record.get("median_s", {}).get(impl)
        parts.append(f"{impl} {t:.3f}s {record['peak_bytes'][impl] / GIB:.2f}GiB" if t else impl)
    line = head + ": " + ", ".join(parts) + " | " + ", ".join(f"{k}={v:.2f}" for k, v in record["ratios"].items())
    for impl, diffs in record.get("referee", {}).items():
        line += f"\n    float64 referee: {impl} max rel. diff {max(diffs.values()):.1e}"
    return line


def _write(path: str, records: list[dict], args: argparse.Namespace) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    meta = {
        "benchmark": "loss_path",
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.loss_path", *sys.argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_description(),
        "budget_gib": args.budget_gib,
        "repeats": args.repeats,
        "full_grid": args.full,
    }
    with open(path, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)


def cpu_description() -> str:
    """CPU model and its vector/matrix extensions (ratios between runs on different CPUs of one kind differ).

    Example:
    ```python
    >>> from benchmarks.loss_path import cpu_description
    >>> isinstance(cpu_description(), str)
    True
    ```
    """
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    isa = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return f"{model}; {' '.join(isa) or 'no AVX2/AVX-512/AMX flags'}"


if __name__ == "__main__":
    sys.exit(main())
