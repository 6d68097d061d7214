"""Property-based (hypothesis) tests of `per_token_divergence` and `weighted_loss` against a float64 reference.

The reference below is written from the definition in numpy float64, without TRL or the package. It uses TRL's
`GKDTrainer.generalized_jsd_loss` convention, which is also the one in `hf_rockopd.losses`:

- `beta == 0`: `KL(teacher ‖ student)`; `beta == 1`: `KL(student ‖ teacher)`;
- `0 < beta < 1`: `beta · KL(teacher ‖ M) + (1 − beta) · KL(student ‖ M)` with
  `M = (1 − beta) · student + beta · teacher`
  (TRL's `logsumexp([student_lp + log1p(-beta), teacher_lp + log(beta)])`).

The support of a distribution is decided exactly from the logits: an entry is in it iff its logit is not `-inf`, so
`0 · log 0 = 0`, and a KL is `+inf` iff its first argument has an entry that its second argument bans. That decision
does not depend on float64 underflow: `exp(-800)` underflows to 0, but the entry is still in the support.

What the package does where the reference is infinite (the properties below assert this):

- value: `+inf` when the offending probability (on the first KL argument's side) is representable in float32
  (log-probability above about -100), a finite value when it underflows to 0 in float32 (log-probability below about
  -110, common with logits of scale 1e3-1e4: then it is the KL over the rest of the support), either in between;
  never NaN;
- gradient with respect to the student logits: finite for `beta == 0` (forward KL: `(s − t) / T`, the student's
  banned entries get `−t`); for `beta == 1` (reverse KL, the student has float32 mass where the teacher has
  `-inf`) it is `-inf`/NaN in that row only (the gradient of an infinite loss; not asserted). Other rows of the
  batch are unaffected. The mixture (`0 < beta < 1`) is never infinite. The trainer raises `FloatingPointError` on
  any non-finite divergence before the backward pass, so that NaN cannot reach an optimizer step.

Edges of `weighted_loss` the strategies stay clear of (float32 range limits, not asserted): the normalizer is cast to
float32, so a positive normalizer below float32's range (say 1e-300) becomes 0 and is then treated as 1; with the
"weights" normalizer and only subnormal weights (Σ w ≈ 1e-45) the backward's `1 / normalizer` overflows and the
gradient is inf. A zero weight on an infinite divergence gives `0 · inf = NaN`; that is why the zero-weight property
only uses -inf layouts with finite divergences (the trainer rejects non-finite divergences before weighting).

Examples per property (`max_examples`, i.e. fuzz cases run per pytest invocation; hypothesis stops earlier only if
the strategy space is exhausted, which it is not here):

- `test_divergence_matches_float64_reference`: 400
- `test_divergence_swap_symmetry`: 150
- `test_student_gradients_finite_and_match_closed_form`: 300
- `test_weighted_loss_matches_float64`: 300
- `test_weighted_loss_is_exactly_zero_without_weight`: 200

1350 fuzz cases in all (`max_examples` counts valid cases; those rejected by `assume` or an overrun draw are redrawn),
plus 9 deterministic checks of the reference itself (one closed-form test, 8 parametrized comparisons with the
package on plain inputs).
"""

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hf_rockopd.losses import per_token_divergence, weighted_loss


EPS32 = float(np.finfo(np.float32).eps)  # 2**-23 ≈ 1.19e-7
SUBNORMAL32 = float(np.finfo(np.float32).smallest_subnormal)  # ≈ 1.4e-45
LOGIT_BOUND = 1e4

# Tolerances (see `_divergence_tolerance` and `_gradient_tolerance`). The package works in float32: the division by
# the temperature and the log-softmax round every log-probability by about EPS32 · (|y| + |max y| + log V), y = z / T,
# and a common shift of all log-probabilities (the rounding of the log-sum-exp) passes into the KL one-for-one
# because Σ p = 1. So the absolute error scales with L = max |finite y| of the row, not with the KL value: at
# |logits| = 1e4 and T = 0.5 the inputs of the log-softmax themselves carry ≈ 2.4e-3 of rounding, and two nearly equal
# distributions there cannot be resolved better in float32. The observed worst case of
# |ours − ref| / (EPS32 · (1 + L + log V)) over tens of thousands of random cases was ≈ 5; the factor 32 is
# headroom. The relative part (1e-5) covers the float32 summation over V ≤ 64 terms.
DIV_ATOL_FACTOR = 32.0
DIV_RTOL = 1e-5
# Gradient (d div / d student logits, per entry): (1 − beta)·s·(a − E_s a) / T with a = log s − log M (or s − t for
# the forward KL); each factor carries the log-probability error above, and |a| multiplies it. Observed worst
# |Δg| / (EPS32 · (1 + L + log V) · (1 + max |a|) / T) was ≈ 0.5; the factor 16 is headroom.
GRAD_ATOL_FACTOR = 16.0
# Above this float64 log-probability an entry's probability is a normal float32 (smallest normal ≈ e^-87.3, smallest
# subnormal ≈ e^-103.3); below the other bound, exp() of it is 0 in float32 whatever the rounding of the log.
REPRESENTABLE_LOGP = -100.0
UNDERFLOW_LOGP = -110.0

# Derandomized by default so that a CI run is reproducible: the same 1350 cases every time. To explore new cases, run
# `HF_ROCKOPD_FUZZ_RANDOM=1 pytest tests/test_fuzz_losses.py --hypothesis-seed=<any int>`.
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("HF_ROCKOPD_FUZZ_RANDOM", "0") != "1",
)


# ---------------------------------------------------------------------------------------------------------------------
# float64 reference, from the definitions
# ---------------------------------------------------------------------------------------------------------------------


def ref_log_softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """log softmax(z / T) in float64; `-inf` logits stay exactly `-inf`. At least one finite entry per row."""
    y = logits.astype(np.float64) / temperature
    finite = np.isfinite(y)
    top = np.where(finite, y, -np.inf).max(-1, keepdims=True)
    shifted = np.where(finite, y - np.where(np.isfinite(top), top, 0.0), -np.inf)
    with np.errstate(under="ignore"):
        lse = np.log(np.exp(shifted).sum(-1, keepdims=True))
    return np.where(finite, shifted - lse, -np.inf)


def ref_kl(log_p: np.ndarray, log_q: np.ndarray, drop_banned: bool = False) -> np.ndarray:
    """KL(p ‖ q) per row: Σ_{p_k > 0} p_k (log p_k − log q_k); `+inf` iff some p_k > 0 has q_k = 0.

    `drop_banned=True` gives the sum over the entries where both are positive instead (the finite part)."""
    support = log_p > -np.inf
    infinite = (support & (log_q == -np.inf)).any(-1)
    both = support & (log_q > -np.inf)
    diff = np.where(both, log_p, 0.0) - np.where(both, log_q, 0.0)
    with np.errstate(under="ignore"):
        terms = np.where(both, np.exp(np.where(both, log_p, 0.0)) * diff, 0.0)
    return terms.sum(-1) if drop_banned else np.where(infinite, np.inf, terms.sum(-1))


def ref_mixture_log(ls: np.ndarray, lt: np.ndarray, beta: float) -> np.ndarray:
    """log((1 − beta) · s + beta · t) for 0 < beta < 1."""
    return np.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))


def ref_divergence(student: np.ndarray, teacher: np.ndarray, beta: float, temperature: float) -> np.ndarray:
    ls, lt = ref_log_softmax(student, temperature), ref_log_softmax(teacher, temperature)
    if beta == 0.0:
        return ref_kl(lt, ls)
    if beta == 1.0:
        return ref_kl(ls, lt)
    lm = ref_mixture_log(ls, lt, beta)
    return beta * ref_kl(lt, lm) + (1.0 - beta) * ref_kl(ls, lm)


def ref_student_gradient(student, teacher, beta, temperature):
    """d divergence / d student logits, per row, and max |a| (the log-ratio that multiplies the rounding errors).

    Derivation (softmax Jacobian ds_k/dy_j = s_k (δ_kj − s_j), y = z / T):
    - beta = 0: d/dy Σ t log(t / s) = s − t (finite even where the KL is infinite);
    - beta = 1: d/ds_k = log(s_k / t_k) + 1, so dy_j = s_j (a_j − Σ s a), a = log s − log t;
    - 0 < beta < 1: d/ds_k = beta · (−t_k (1 − beta) / m_k) + (1 − beta)(log(s_k / m_k) + 1 − (1 − beta) s_k / m_k)
      = (1 − beta) log(s_k / m_k) + const, so dy_j = (1 − beta) s_j (a_j − Σ s a), a = log s − log m.
    Only meaningful where the divergence is finite (except beta = 0).
    """
    ls, lt = ref_log_softmax(student, temperature), ref_log_softmax(teacher, temperature)
    with np.errstate(under="ignore"):
        s, t = np.exp(ls), np.exp(lt)
    if beta == 0.0:
        return (s - t) / temperature, np.zeros(len(student))
    other, factor = (lt, 1.0) if beta == 1.0 else (ref_mixture_log(ls, lt, beta), 1.0 - beta)
    ok = (ls > -np.inf) & (other > -np.inf)
    a = np.where(ok, np.where(ok, ls, 0.0) - np.where(ok, other, 0.0), 0.0)
    grad = factor * s * (a - (s * a).sum(-1, keepdims=True)) / temperature
    return grad, np.abs(a).max(-1, initial=0.0)


def _row_scale(student, teacher, temperature):
    """L = max |finite z / T| over both rows."""
    ys = np.where(np.isfinite(student), np.abs(student.astype(np.float64)) / temperature, 0.0)
    yt = np.where(np.isfinite(teacher), np.abs(teacher.astype(np.float64)) / temperature, 0.0)
    return np.maximum(ys.max(-1, initial=0.0), yt.max(-1, initial=0.0))


def _divergence_tolerance(student, teacher, temperature, reference):
    scale = 1.0 + _row_scale(student, teacher, temperature) + math.log(student.shape[-1])
    return DIV_ATOL_FACTOR * EPS32 * scale + DIV_RTOL * np.abs(reference)


def _gradient_tolerance(student, teacher, temperature, max_abs_a):
    scale = 1.0 + _row_scale(student, teacher, temperature) + math.log(student.shape[-1])
    return GRAD_ATOL_FACTOR * EPS32 * scale * (1.0 + max_abs_a) / temperature


# ---------------------------------------------------------------------------------------------------------------------
# The reference itself, on cases with known answers and against the package on plain inputs
# ---------------------------------------------------------------------------------------------------------------------


def test_reference_closed_forms():
    half, quarter = np.log([[0.5, 0.5]]), np.log([[0.25, 0.75]])
    kl_pq = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl_qp = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    # student = half, teacher = quarter: beta 0 is KL(teacher ‖ student), beta 1 is KL(student ‖ teacher).
    assert ref_divergence(half, quarter, 0.0, 1.0)[0] == pytest.approx(kl_qp, rel=1e-12)
    assert ref_divergence(half, quarter, 1.0, 1.0)[0] == pytest.approx(kl_pq, rel=1e-12)
    m = 0.75 * np.array([0.5, 0.5]) + 0.25 * np.array([0.25, 0.75])  # beta = 0.25: M = 0.75 s + 0.25 t
    jsd = 0.25 * sum(q * math.log(q / mk) for q, mk in zip([0.25, 0.75], m)) + 0.75 * sum(
        0.5 * math.log(0.5 / mk) for mk in m
    )
    assert ref_divergence(half, quarter, 0.25, 1.0)[0] == pytest.approx(jsd, rel=1e-12)
    # Disjoint supports: both KLs infinite, the symmetric JSD is log 2.
    s, t = np.array([[0.0, -np.inf]]), np.array([[-np.inf, 0.0]])
    assert ref_divergence(s, t, 0.0, 1.0)[0] == np.inf and ref_divergence(s, t, 1.0, 1.0)[0] == np.inf
    assert ref_divergence(s, t, 0.5, 1.0)[0] == pytest.approx(math.log(2), rel=1e-12)
    # A banned entry on the second argument's side only matters if the first argument puts mass there.
    s2, t2 = np.array([[0.0, 0.0]]), np.array([[0.0, -np.inf]])
    assert ref_divergence(s2, t2, 0.0, 1.0)[0] == pytest.approx(math.log(2), rel=1e-12)  # KL(t ‖ s), t = (1, 0)
    assert ref_divergence(s2, t2, 1.0, 1.0)[0] == np.inf
    # Temperature divides the logits; underflowing probabilities (exp(-2e4)) stay in the support.
    z = np.array([[0.0, -2e4]])
    assert ref_divergence(z, np.array([[0.0, -np.inf]]), 1.0, 1.0)[0] == np.inf
    assert ref_divergence(z * 2, z, 0.5, 2.0)[0] == pytest.approx(ref_divergence(z, z / 2, 0.5, 1.0)[0], abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_reference_agrees_with_package_on_plain_inputs(beta, temperature):
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((9, 31)) * 3).astype(np.float32)
    t = (rng.standard_normal((9, 31)) * 3).astype(np.float32)
    ours = per_token_divergence(torch.from_numpy(s), torch.from_numpy(t), beta, temperature).double().numpy()
    np.testing.assert_allclose(ours, ref_divergence(s, t, beta, temperature), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------------------------------

betas = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0))
temperatures = st.one_of(st.sampled_from([0.5, 1.0, 2.0]), st.floats(0.5, 2.0))
# Where the -inf entries go. "student_only" / "teacher_only": one model bans entries the other does not.
INF_MODES = ["none", "shared", "student_only", "teacher_only", "independent"]


@st.composite
def logit_pairs(draw, min_rows=0, inf_modes=INF_MODES):
    """Float32 (N, V) student and teacher logits with |finite logits| ≤ 1e4 and ≥ 1 finite entry per row."""
    n = draw(st.integers(min_rows, 16))
    v = draw(st.integers(2, 64))
    scale = draw(st.one_of(st.sampled_from([1.0, 1e4]), st.floats(-2.0, 4.0).map(lambda e: 10.0**e)))
    shape = draw(st.sampled_from(["normal", "uniform", "peaked"]))
    relation = draw(st.sampled_from(["independent", "perturbed", "identical", "shifted"]))
    inf_mode = draw(st.sampled_from(inf_modes))
    inf_fraction = draw(st.floats(0.0, 0.95))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def sample():
        if shape == "normal":
            x = rng.standard_normal((n, v))
        elif shape == "uniform":
            x = rng.uniform(-1.0, 1.0, (n, v))
        else:  # one dominant entry per row: a near one-hot distribution
            x = rng.uniform(-1.0, 0.0, (n, v))
            x[np.arange(n), rng.integers(v, size=n)] = 1.0
        return x * scale

    student = sample()
    if relation == "independent":
        teacher = sample()
    elif relation == "perturbed":  # nearly equal distributions: a tiny divergence, the hardest relative case
        teacher = student + rng.standard_normal((n, v)) * scale * 10.0 ** rng.uniform(-6, -1)
    elif relation == "identical":
        teacher = student.copy()
    else:  # the same distribution, shifted logits
        teacher = student + rng.uniform(-scale, scale, (n, 1))
    student = np.clip(student, -LOGIT_BOUND, LOGIT_BOUND).astype(np.float32)
    teacher = np.clip(teacher, -LOGIT_BOUND, LOGIT_BOUND).astype(np.float32)

    def banned():
        mask = rng.uniform(size=(n, v)) < inf_fraction
        mask[np.arange(n), rng.integers(v, size=n)] = False  # keep one finite entry per row
        return mask

    student_ban = teacher_ban = np.zeros((n, v), dtype=bool)
    if inf_mode == "shared":
        student_ban = teacher_ban = banned()
    elif inf_mode == "student_only":
        student_ban = banned()
    elif inf_mode == "teacher_only":
        teacher_ban = banned()
    elif inf_mode == "independent":
        student_ban, teacher_ban = banned(), banned()
    student[student_ban] = -np.inf
    teacher[teacher_ban] = -np.inf
    return student, teacher


def _finite_inf_modes(beta):
    """-inf layouts for which the reference divergence is finite in every row."""
    if beta == 0.0:
        return ["none", "shared", "teacher_only"]  # KL(t ‖ s) needs supp t ⊆ supp s
    if beta == 1.0:
        return ["none", "shared", "student_only"]  # KL(s ‖ t) needs supp s ⊆ supp t
    return INF_MODES  # the mixture covers both supports


# ---------------------------------------------------------------------------------------------------------------------
# per_token_divergence
# ---------------------------------------------------------------------------------------------------------------------


@settings(FUZZ, max_examples=400)
@given(pair=logit_pairs(), beta=betas, temperature=temperatures)
def test_divergence_matches_float64_reference(pair, beta, temperature):
    student, teacher = pair
    ours = per_token_divergence(torch.from_numpy(student), torch.from_numpy(teacher), beta, temperature)
    assert ours.dtype == torch.float32 and ours.shape == (student.shape[0],)
    ours = ours.double().numpy()
    reference = ref_divergence(student, teacher, beta, temperature)
    assert not np.isnan(ours).any()

    finite = np.isfinite(reference)
    assert np.isfinite(ours[finite]).all(), "package is non-finite where the float64 reference is finite"
    tolerance = _divergence_tolerance(student, teacher, temperature, reference)
    with np.errstate(invalid="ignore"):  # inf - inf in rows that are checked separately below
        error = np.abs(ours - reference)
    assert (error[finite] <= tolerance[finite]).all(), (
        f"max excess {np.max((error - tolerance)[finite])}, rows {np.flatnonzero(finite & (error > tolerance))}"
    )

    if (~finite).any():
        assert beta in (0.0, 1.0), "the mixture divergence is never infinite"
        # The first KL argument's log-probabilities on the entries the second argument bans.
        ls, lt = ref_log_softmax(student, temperature), ref_log_softmax(teacher, temperature)
        first, second = (lt, ls) if beta == 0.0 else (ls, lt)
        offending = np.where((first > -np.inf) & (second == -np.inf), first, -np.inf).max(-1)
        must_be_inf = ~finite & (offending > REPRESENTABLE_LOGP)
        must_be_finite = ~finite & (offending < UNDERFLOW_LOGP)
        assert (ours[must_be_inf] == np.inf).all()
        assert np.isfinite(ours[must_be_finite]).all()
        # There the banned entries carry float32 mass 0 and the package returns the KL over the rest of the support.
        finite_part = ref_kl(first, second, drop_banned=True)
        part_tolerance = _divergence_tolerance(student, teacher, temperature, finite_part)
        assert (np.abs(ours - finite_part)[must_be_finite] <= part_tolerance[must_be_finite]).all()


@settings(FUZZ, max_examples=150)
@given(pair=logit_pairs(min_rows=1), beta=betas, temperature=temperatures)
def test_divergence_swap_symmetry(pair, beta, temperature):
    """JSD_beta(s, t) = JSD_{1 − beta}(t, s) in TRL's convention (M is the same mixture); beta 0 ↔ 1 swaps the KL.

    `1 − beta` is rounded in float64, an O(1e-16) change of the mixture weight, far below the tolerance."""
    student, teacher = pair
    swapped_beta = 1.0 - beta
    # TRL's convention is discontinuous at the endpoints (the mixture form tends to 0 as beta -> 0 or 1, the endpoints
    # are the two KLs): a tiny beta whose 1 - beta rounds to exactly 1.0 would compare a mixture with a KL.
    assume(beta in (0.0, 1.0) or 0.0 < swapped_beta < 1.0)
    a = per_token_divergence(torch.from_numpy(student), torch.from_numpy(teacher), beta, temperature).double().numpy()
    b = per_token_divergence(torch.from_numpy(teacher), torch.from_numpy(student), swapped_beta, temperature)
    b = b.double().numpy()
    reference = ref_divergence(student, teacher, beta, temperature)
    finite = np.isfinite(reference) & np.isfinite(a) & np.isfinite(b)
    tolerance = 2 * _divergence_tolerance(student, teacher, temperature, reference)
    with np.errstate(invalid="ignore"):
        assert (np.abs(a - b)[finite] <= tolerance[finite]).all()
    assert (np.isinf(a) == np.isinf(b)).all()


@settings(FUZZ, max_examples=300)
@given(pair=logit_pairs(), beta=betas, temperature=temperatures, data=st.data())
def test_student_gradients_finite_and_match_closed_form(pair, beta, temperature, data):
    student, teacher = pair
    n = student.shape[0]
    row_weights = data.draw(hnp.arrays(np.float32, n, elements=st.floats(0.0, 2.0, width=32)))
    x = torch.from_numpy(student.copy()).requires_grad_(True)
    divergence = per_token_divergence(x, torch.from_numpy(teacher), beta, temperature)
    (grad,) = torch.autograd.grad((divergence * torch.from_numpy(row_weights)).sum(), x)
    assert grad.dtype == torch.float32 and grad.shape == student.shape
    grad = grad.double().numpy()

    reference = ref_divergence(student, teacher, beta, temperature)
    # Rows whose divergence is finite (with or without -inf entries), and every forward-KL row: finite gradients.
    checked = np.isfinite(reference) | (beta == 0.0)
    assert np.isfinite(grad[checked]).all(), "non-finite gradient in a row whose gradient is defined"

    expected, max_abs_a = ref_student_gradient(student, teacher, beta, temperature)
    expected = expected * row_weights.astype(np.float64)[:, None]
    tolerance = _gradient_tolerance(student, teacher, temperature, max_abs_a) * np.maximum(row_weights, 1e-30)
    error = np.abs(grad - expected).max(-1, initial=0.0)
    assert (error[checked] <= tolerance[checked]).all(), f"max excess {np.max((error - tolerance)[checked])}"
    # Zero-weight rows contribute exactly zero gradient when their gradient is defined.
    assert (grad[checked & (row_weights == 0)] == 0).all()


# ---------------------------------------------------------------------------------------------------------------------
# weighted_loss
# ---------------------------------------------------------------------------------------------------------------------

NORMALIZERS = ["tokens", "weights", "python_float", "python_int", "tensor_float64"]


def _normalizer(kind, weights, mask, data):
    if kind == "tokens":
        return torch.from_numpy(mask).sum()  # int64 tensor: the trainer's "tokens" normalizer
    if kind == "weights":
        return torch.from_numpy(weights).sum()  # float32 tensor: the "weights" normalizer
    # Explicit normalizers are 0 (empty batch) or in [1e-3, 1e4]: the package casts the normalizer to float32, so a
    # positive value below float32's range (e.g. 1e-300) would become 0 and then be treated as 1.
    explicit = st.one_of(st.just(0.0), st.floats(1e-3, 1e4))
    if kind == "python_float":
        return data.draw(explicit)
    if kind == "python_int":
        return data.draw(st.integers(0, 10_000))
    return torch.tensor(data.draw(explicit), dtype=torch.float64)


@settings(FUZZ, max_examples=300)
@given(
    divergence=st.integers(0, 16).flatmap(
        lambda n: hnp.arrays(np.float32, n, elements=st.floats(0.0, 1e4, width=32))
    ),
    data=st.data(),
    kind=st.sampled_from(NORMALIZERS),
)
def test_weighted_loss_matches_float64(divergence, data, kind):
    n = divergence.shape[0]
    # Normal (non-subnormal) weights: with a "weights" normalizer made only of subnormal weights, e.g. Σ w = 1e-45,
    # the backward's 1 / normalizer overflows float32 and the gradient is inf (see the module docstring).
    raw = data.draw(hnp.arrays(np.float32, n, elements=st.floats(0.0, 2.0, width=32, allow_subnormal=False)))
    mask = data.draw(hnp.arrays(np.bool_, n))
    weights = np.where(mask, raw, np.float32(0.0)).astype(np.float32)
    normalizer = _normalizer(kind, weights, mask, data)

    div_t = torch.from_numpy(divergence).requires_grad_(True)
    loss = weighted_loss(div_t, torch.from_numpy(weights), normalizer)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)

    norm64 = float(normalizer) if not torch.is_tensor(normalizer) else float(normalizer.double())
    norm64 = norm64 if norm64 > 0 else 1.0
    expected = float((weights.astype(np.float64) * divergence.astype(np.float64)).sum()) / norm64
    # float32: n rounded products, n − 1 additions, the normalizer's rounding to float32 and the division, each a
    # relative EPS32 / 2 of at most the magnitude below; products that fall into the subnormal range are rounded
    # with an absolute error of up to half the smallest subnormal instead, and so is a quotient that is itself
    # subnormal (e.g. 0.5 · 1.2e-38 / 46), whatever the normalizer.
    magnitude = float(np.abs(weights.astype(np.float64) * divergence).sum()) / norm64
    tolerance = 4 * (n + 2) * EPS32 * magnitude + (n + 1) * SUBNORMAL32 / norm64 + SUBNORMAL32
    assert abs(loss.detach().item() - expected) <= tolerance

    (grad,) = torch.autograd.grad(loss, div_t)
    assert torch.isfinite(grad).all()
    # d loss / d div_i = w_i / normalizer: two float32 roundings (1 / normalizer, then the product).
    np.testing.assert_allclose(
        grad.double().numpy(), weights.astype(np.float64) / norm64, rtol=4 * EPS32, atol=SUBNORMAL32
    )


@settings(FUZZ, max_examples=200)
@given(
    beta=betas,
    temperature=temperatures,
    kind=st.sampled_from(["tokens", "weights", "python_zero"]),
    empty=st.sampled_from(["empty_mask", "zero_weights", "no_rows"]),
    data=st.data(),
)
def test_weighted_loss_is_exactly_zero_without_weight(beta, temperature, kind, empty, data):
    """No valid token, or no weight: the loss is exactly 0.0 and every gradient is a finite 0, through the divergence
    (including rows with -inf entries; the layouts are those whose divergence is finite)."""
    min_rows = 0 if empty == "no_rows" else 1
    student, teacher = data.draw(logit_pairs(min_rows=min_rows, inf_modes=_finite_inf_modes(beta)))
    if empty == "no_rows":
        student, teacher = student[:0], teacher[:0]
    n = student.shape[0]
    raw = data.draw(hnp.arrays(np.float32, n, elements=st.floats(0.0, 2.0, width=32)))
    if empty == "zero_weights":
        mask = data.draw(hnp.arrays(np.bool_, n))
        weights = np.zeros(n, dtype=np.float32)
    else:
        mask = np.zeros(n, dtype=bool)
        weights = np.where(mask, raw, np.float32(0.0)).astype(np.float32)
    normalizer = {
        "tokens": torch.from_numpy(mask).sum(),
        "weights": torch.from_numpy(weights).sum(),
        "python_zero": 0,
    }[kind]

    x = torch.from_numpy(student.copy()).requires_grad_(True)
    divergence = per_token_divergence(x, torch.from_numpy(teacher), beta, temperature)
    assert torch.isfinite(divergence).all()
    loss = weighted_loss(divergence, torch.from_numpy(weights), normalizer)
    assert loss.detach().item() == 0.0 and loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(grad).all() and (grad == 0).all()
