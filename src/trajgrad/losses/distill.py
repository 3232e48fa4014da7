r"""On-policy distillation over the full vocabulary (spec §14, §15).

The student :math:`\pi_\theta` generates the trajectory; at every student-visited prefix
:math:`h` a teacher :math:`\pi_E` supplies its *full* next-token distribution, and the loss
is a divergence between the two distributions summed over the whole vocabulary:

==============================  ===================================================================
``reverse_kl_distill_loss``     :math:`\sum_v\pi_\theta(v|h)[\log\pi_\theta(v|h)-\log\pi_E(v|h)]`
                                (§14; mode seeking)
``forward_kl_distill_loss``     :math:`\sum_v\pi_E(v|h)[\log\pi_E(v|h)-\log\pi_\theta(v|h)]`
                                (mass covering)
``jsd_distill_loss``            generalized Jensen–Shannon :math:`\mathrm{JSD}(\beta)`, between the two
``multi_teacher_distill_loss``  :math:`\sum_i w_i(h)\,\mathrm{KL}(\pi_\theta\Vert\pi_{E_i})` (§15)
``sampled_token_kl``            :math:`\log\pi_\theta(y_t|h)-\log\pi_E(y_t|h)` at the sampled token only:
                                *a different objective* (see its docstring)
==============================  ===================================================================

**Inputs.** Each side is given either as logits ``[B, L, V]`` or as a pair
``(hidden [B, L, H], head weight [V, H])`` (plus an optional ``[V]`` bias); the sides may
mix (student logits against cached teacher hidden states). Positions are aligned with the
targets (§4), ``mask`` ``[B, L]`` marks the student-sampled action tokens; values at masked
positions (NaN included) are never read.

**Exactness without** ``[B, L, V]``. Every loss runs the chunked kernel
:func:`trajgrad.fused.weighted_divergence`: ``chunk_size`` positions at a time it forms
both logits, the divergence and its gradient w.r.t. the student logits, and pushes that
gradient through the head at once (two matrix products); only ``O(chunk_size * V)``
floats are alive, and no ``[B, L, V]`` tensor is created on the hidden-state path. The
loss is linear in the per-position divergences, :math:`\mathcal L=\sum_n\omega_n D_n`,
where :math:`\omega_n=\partial\,\mathrm{aggregate}/\partial x_n` are the weights of
:func:`trajgrad.aggregate.aggregate` for the chosen ``aggregation`` (obtained from
``aggregate`` itself), which is why the gradient can be formed in the forward pass. The
backward pass then only scales it; it can run once per forward unless
``retain_graph=True``.

**Detached.** Everything of the teacher (logits, hidden states, head). Gradients flow to
the student logits, or to the student hidden states, head weight and bias.

**Aggregation.** Default ``token_mean``: §14's exact code ends with
``masked_mean(reverse_kl, action_mask)``, i.e. every student token weighs the same, as in
the on-policy distillation papers (GKD, Agarwal et al. 2024; MiniLLM, Gu et al. 2024).

**Temperature.** Both distributions are :math:`\operatorname{softmax}(z/T)` with the same
``temperature``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _checks
from ..aggregate import MODES, aggregate
from ..fused import Head, check_finite_fast, check_head, check_sizes, head_entropy, weighted_divergence
from ..types import LossResult

__all__ = [
    "reverse_kl_distill_loss",
    "forward_kl_distill_loss",
    "jsd_distill_loss",
    "sampled_token_kl",
    "multi_teacher_distill_loss",
]

Number = Union[float, int, torch.Tensor]


# ----------------------------------------------------------------------------------------
# input handling
# ----------------------------------------------------------------------------------------


def _check_mask(mask) -> torch.Tensor:
    if mask is None:
        raise ValueError("mask: required ([B, L] 0/1 action mask)")
    mask = _checks.check_mask("mask", mask)
    _checks.check_ndim("mask", mask, 2)
    return mask


def _side(prefix: str, logits, hidden, weight, bias, mask: torch.Tensor, *, detach: bool) -> Head:
    """Validate one side (``<prefix>_logits`` or ``<prefix>_hidden`` + ``<prefix>_weight``)."""
    ln, hn, wn, bn = f"{prefix}_logits", f"{prefix}_hidden", f"{prefix}_weight", f"{prefix}_bias"
    if logits is not None and (hidden is not None or weight is not None):
        raise ValueError(f"{ln}: give either {ln} or {hn} with {wn}, not both")
    if logits is None and hidden is None and weight is None:
        raise ValueError(f"{ln}: missing; give {ln} [B, L, V] or {hn} [B, L, H] with {wn} [V, H]")
    if logits is None and hidden is None:
        raise ValueError(f"{hn}: required together with {wn}")
    if logits is None and weight is None:
        raise ValueError(f"{wn}: required together with {hn}")
    if logits is not None and bias is not None:
        raise ValueError(f"{bn}: only used with {hn}/{wn}, not with {ln}")
    return _make_head(ln, hn, wn, bn, logits, hidden, weight, bias, mask, detach=detach)


def _make_head(ln, hn, wn, bn, logits, hidden, weight, bias, mask, *, detach: bool) -> Head:
    B, L = mask.shape
    if logits is not None:
        logits = _checks.as_tensor(ln, logits)
        _checks.check_floating(ln, logits)
        _checks.check_ndim(ln, logits, 3)
        if tuple(logits.shape[:2]) != (B, L):
            raise ValueError(f"{ln}: expected shape ({B}, {L}, V) (the shape of mask + a vocabulary "
                             f"dimension), got {tuple(logits.shape)}")
        if logits.shape[2] < 1:
            raise ValueError(f"{ln}: the vocabulary is empty")
        check_finite_fast(ln, logits, mask)
        if detach:
            logits = logits.detach()
        return Head(logits.reshape(B * L, logits.shape[2]))
    hidden, weight, bias = check_head(hn, hidden, wn, weight, bn, bias, lead_shape=(B, L), mask=mask)
    if detach:
        hidden, weight = hidden.detach(), weight.detach()
        bias = None if bias is None else bias.detach()
    return Head(hidden.reshape(B * L, hidden.shape[2]), weight, bias)


def _token_weights(mask: torch.Tensor, aggregation: str, constant, denominator, dtype, device) -> torch.Tensor:
    r""":math:`\omega = \partial\,\mathrm{aggregate}(x)/\partial x` (``[B, L]``), from ``aggregate`` itself.

    Every mode is linear in the per-token terms, so this gradient is the exact weight of
    each position in the aggregated loss.
    """
    _checks.check_choice("aggregation", aggregation, MODES)
    probe = torch.zeros(mask.shape, dtype=dtype, device=device, requires_grad=True)
    with torch.enable_grad():
        total = aggregate(probe, mask, aggregation, constant=constant, denominator=denominator)
        (omega,) = torch.autograd.grad(total, probe)
    return omega


def _common_checks(temperature, chunk_size, aggregation) -> None:
    check_sizes(temperature, chunk_size)
    _checks.check_choice("aggregation", aggregation, MODES)


def _vocab_match(student: Head, teacher: Head, teacher_name: str) -> None:
    if student.vocab != teacher.vocab:
        raise ValueError(f"{teacher_name}: the teacher vocabulary has {teacher.vocab} entries but the student's "
                         f"has {student.vocab}; the divergences need one vocabulary")


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.sum() / max(int(x.numel()), 1)


def _single_teacher(kind: str, beta: float, normalized: bool, metric: str, *,
                    student_logits, teacher_logits, student_hidden, student_weight, student_bias,
                    teacher_hidden, teacher_weight, teacher_bias, mask, temperature, aggregation,
                    constant, denominator, chunk_size) -> LossResult:
    mask = _check_mask(mask)
    _common_checks(temperature, chunk_size, aggregation)
    student = _side("student", student_logits, student_hidden, student_weight, student_bias, mask, detach=False)
    teacher = _side("teacher", teacher_logits, teacher_hidden, teacher_weight, teacher_bias, mask, detach=True)
    _vocab_match(student, teacher, "teacher_logits" if teacher_logits is not None else "teacher_weight")
    dtype = student.x.dtype if student.x.dtype in (torch.float32, torch.float64) else torch.float32
    omega = _token_weights(mask, aggregation, constant, denominator, dtype, student.x.device)
    rows = mask.reshape(-1).nonzero().squeeze(1)
    loss, (div,), (ent_s,), (ent_t,) = weighted_divergence(
        student, [(teacher, rows, omega.reshape(-1).index_select(0, rows))],
        kind=kind, beta=beta, normalized=normalized, temperature=temperature, chunk_size=chunk_size)
    metrics: Dict[str, torch.Tensor] = {
        metric: _mean(div),
        "student_entropy": _mean(ent_s),
        "teacher_entropy": _mean(ent_t),
        "token_count": torch.tensor(float(rows.numel()), dtype=div.dtype, device=div.device),
    }
    return LossResult(loss, metrics)


# ----------------------------------------------------------------------------------------
# single-teacher losses
# ----------------------------------------------------------------------------------------


def reverse_kl_distill_loss(
    *,
    student_logits: Optional[torch.Tensor] = None,
    teacher_logits: Optional[torch.Tensor] = None,
    student_hidden: Optional[torch.Tensor] = None,
    student_weight: Optional[torch.Tensor] = None,
    teacher_hidden: Optional[torch.Tensor] = None,
    teacher_weight: Optional[torch.Tensor] = None,
    mask: torch.Tensor,
    temperature: float = 1.0,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
    chunk_size: int = 1024,
    student_bias: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
) -> LossResult:
    r"""Exact reverse-KL on-policy distillation over the full vocabulary (§14).

    .. math::

       D_n = \mathrm{KL}\big(\pi_\theta(\cdot|h_n)\,\Vert\,\pi_E(\cdot|h_n)\big)
           = \sum_{v=1}^{V}\pi_\theta(v|h_n)\big[\log\pi_\theta(v|h_n)-\log\pi_E(v|h_n)\big],
       \qquad \mathcal L = \mathrm{aggregate}(D, \text{mask})

    with :math:`\pi = \operatorname{softmax}(z/T)`. The gradient w.r.t. the student logits
    is :math:`\partial D_n/\partial z_{n,v} = \pi_\theta(v)\,[\log\pi_\theta(v)-\log\pi_E(v)-D_n]/T`.
    This is the exact objective of §14's code, not the sampled-token approximation
    (:func:`sampled_token_kl`). Mode seeking: the student is pushed off tokens the teacher
    gives low probability, and may drop teacher modes.

    Papers: Gu et al., "MiniLLM: Knowledge Distillation of Large Language Models", 2024
    (reverse KL); Agarwal et al., "On-Policy Distillation of Language Models" (GKD), 2024
    (on-policy student samples).

    Args:
      student_logits: ``[B, L, V]`` student logits (attached); or instead
      student_hidden: ``[B, L, H]`` last hidden states with ``student_weight`` ``[V, H]``
        (and optional ``student_bias`` ``[V]``): the logits are formed chunk by chunk and
        never held for all positions.
      teacher_logits / teacher_hidden, teacher_weight, teacher_bias: the same for the
        teacher (e.g. hidden states from a cache, one head loaded at a time); detached.
      mask: ``[B, L]`` 0/1 action mask (student-sampled tokens). Required.
      temperature: :math:`T>0`, applied to both sides.
      aggregation, constant, denominator: see :func:`trajgrad.aggregate.aggregate`.
        Default ``token_mean`` (§14's ``masked_mean``).
      chunk_size: positions per chunk; peak extra memory about ``3 * chunk_size * V``
        floats.

    Returns:
      ``LossResult(loss, metrics)``; metrics (detached): ``reverse_kl`` (mean per valid
      token), ``student_entropy``, ``teacher_entropy`` (mean per valid token, nats),
      ``token_count``.

    Raises:
      ValueError naming the argument: missing or conflicting inputs, shape or vocabulary
      mismatch, a mask that is not 0/1, NaN/inf at a valid position, ``temperature <= 0``.
    """
    return _single_teacher(
        "reverse_kl", 0.5, True, "reverse_kl", student_logits=student_logits, teacher_logits=teacher_logits,
        student_hidden=student_hidden, student_weight=student_weight, student_bias=student_bias,
        teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias, mask=mask,
        temperature=temperature, aggregation=aggregation, constant=constant, denominator=denominator,
        chunk_size=chunk_size)


def forward_kl_distill_loss(
    *,
    student_logits: Optional[torch.Tensor] = None,
    teacher_logits: Optional[torch.Tensor] = None,
    student_hidden: Optional[torch.Tensor] = None,
    student_weight: Optional[torch.Tensor] = None,
    teacher_hidden: Optional[torch.Tensor] = None,
    teacher_weight: Optional[torch.Tensor] = None,
    mask: torch.Tensor,
    temperature: float = 1.0,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
    chunk_size: int = 1024,
    student_bias: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
) -> LossResult:
    r"""Exact forward-KL distillation at student-visited positions (§14 inputs, other direction).

    .. math::

       D_n = \mathrm{KL}\big(\pi_E(\cdot|h_n)\,\Vert\,\pi_\theta(\cdot|h_n)\big)
           = \sum_{v}\pi_E(v|h_n)\big[\log\pi_E(v|h_n)-\log\pi_\theta(v|h_n)\big],
       \qquad \frac{\partial D_n}{\partial z_{n,v}} = \frac{\pi_\theta(v)-\pi_E(v)}{T}

    (token-level cross-entropy to the teacher minus its constant entropy). Mass covering:
    the student is pulled onto every token the teacher supports. Same arguments, detaching
    and default aggregation as :func:`reverse_kl_distill_loss`; the divergence metric is
    ``forward_kl``.

    Paper: Hinton et al., "Distilling the Knowledge in a Neural Network", 2015 (forward
    KL to soft targets); GKD (Agarwal et al., 2024) on student-generated prefixes.
    """
    return _single_teacher(
        "forward_kl", 0.5, True, "forward_kl", student_logits=student_logits, teacher_logits=teacher_logits,
        student_hidden=student_hidden, student_weight=student_weight, student_bias=student_bias,
        teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias, mask=mask,
        temperature=temperature, aggregation=aggregation, constant=constant, denominator=denominator,
        chunk_size=chunk_size)


def jsd_distill_loss(
    *,
    student_logits: Optional[torch.Tensor] = None,
    teacher_logits: Optional[torch.Tensor] = None,
    student_hidden: Optional[torch.Tensor] = None,
    student_weight: Optional[torch.Tensor] = None,
    teacher_hidden: Optional[torch.Tensor] = None,
    teacher_weight: Optional[torch.Tensor] = None,
    mask: torch.Tensor,
    beta: float = 0.5,
    normalized: bool = True,
    temperature: float = 1.0,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
    chunk_size: int = 1024,
    student_bias: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
) -> LossResult:
    r"""Generalized Jensen–Shannon distillation :math:`\mathrm{JSD}(\beta)`, exact over the vocabulary.

    Convention (the weight :math:`\beta` belongs to the **teacher**):

    .. math::

       m_\beta = \beta\,\pi_E + (1-\beta)\,\pi_\theta,\qquad
       \mathrm{JSD}(\beta) = \beta\,\mathrm{KL}(\pi_E\Vert m_\beta)
                           + (1-\beta)\,\mathrm{KL}(\pi_\theta\Vert m_\beta).

    As :math:`\beta\to0`, :math:`m_\beta\to\pi_\theta` and
    :math:`\mathrm{JSD}(\beta)=\beta\,\mathrm{KL}(\pi_E\Vert\pi_\theta)+O(\beta^2)`; as
    :math:`\beta\to1`, :math:`\mathrm{JSD}(\beta)=(1-\beta)\,\mathrm{KL}(\pi_\theta\Vert\pi_E)+O((1-\beta)^2)`.
    Hence

    * ``normalized=True`` (default) returns :math:`\mathrm{JSD}(\beta)/(\beta(1-\beta))`,
      continuous on :math:`[0,1]`: it tends to the **forward** KL
      :math:`\mathrm{KL}(\pi_E\Vert\pi_\theta)` as :math:`\beta\to0` and to the **reverse**
      KL :math:`\mathrm{KL}(\pi_\theta\Vert\pi_E)` as :math:`\beta\to1`, and at
      :math:`\beta\in\{0,1\}` it *is* that limit (value and gradient), computed by the same
      formula with :math:`\log m_\beta-\log\pi` divided by its weight replaced by its limit
      (``expm1`` of the log-ratio). At :math:`\beta=1/2` it is :math:`4\times` the
      symmetric Jensen–Shannon divergence.
    * ``normalized=False`` returns :math:`\mathrm{JSD}(\beta)` itself, which tends to 0 at
      both ends (and is exactly 0 at :math:`\beta\in\{0,1\}`, with zero gradient): it
      vanishes there because the mixture collapses onto the distribution that carries all
      the weight. At :math:`\beta=1/2` it is the symmetric JS divergence, :math:`\le\log 2`.

    Gradient w.r.t. the student logits (unnormalized; divide by :math:`\beta(1-\beta)` for
    the normalized form):
    :math:`(1-\beta)\,\pi_\theta(v)\,[\log\pi_\theta(v)-\log m_\beta(v)-\mathrm{KL}(\pi_\theta\Vert m_\beta)]/T`.
    The log-mixture ratios are evaluated as ``log1p(w * expm1(x))`` (or ``logaddexp`` for
    large :math:`|x|`), which stays accurate as :math:`\beta` approaches 0 or 1.

    Paper: Agarwal et al., "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), 2024, generalized JSD with the same mixture weights.
    Same arguments, detaching and default aggregation as
    :func:`reverse_kl_distill_loss`; the divergence metric is ``jsd`` (the value that is
    aggregated, normalized or not).

    Raises:
      ValueError: ``beta`` outside ``[0, 1]`` (naming ``beta``), and as
      :func:`reverse_kl_distill_loss`.
    """
    try:
        beta_f = float(beta)
    except (TypeError, ValueError):
        raise ValueError(f"beta: expected a number in [0, 1], got {beta!r}") from None
    _checks.check_in_range("beta", beta_f, 0.0, 1.0)
    return _single_teacher(
        "jsd", beta_f, bool(normalized), "jsd", student_logits=student_logits, teacher_logits=teacher_logits,
        student_hidden=student_hidden, student_weight=student_weight, student_bias=student_bias,
        teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias, mask=mask,
        temperature=temperature, aggregation=aggregation, constant=constant, denominator=denominator,
        chunk_size=chunk_size)


# ----------------------------------------------------------------------------------------
# sampled-token approximation
# ----------------------------------------------------------------------------------------


def sampled_token_kl(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
) -> LossResult:
    r"""Sampled-token approximation :math:`k_1 = \log\pi_\theta(y_t|h_t) - \log\pi_E(y_t|h_t)` (§14).

    .. math::

       k_{1,t} = \log\pi_\theta(y_t\mid h_t) - \mathrm{sg}[\log\pi_E(y_t\mid h_t)],
       \qquad y_t\sim\pi_\theta(\cdot\mid h_t),\qquad
       \mathcal L = \mathrm{aggregate}(k_1, \text{mask})

    **This is a different objective from the exact reverse KL** (§14: "This is not the
    sampled-token approximation"). It uses only the sampled token: a single-sample (k1)
    Monte Carlo estimate of the *value* :math:`\mathrm{KL}(\pi_\theta\Vert\pi_E)`,
    unbiased when :math:`y_t\sim\pi_\theta`, with variance the exact computation does not
    have. Its *gradient as a loss* is not the reverse-KL gradient: differentiating through
    the log-probability gives :math:`\nabla\log\pi_\theta(y_t)`, whose expectation under
    :math:`y_t\sim\pi_\theta` is zero (the score-function identity), whereas
    :math:`\nabla\mathrm{KL}=\mathbb E_{y\sim\pi_\theta}[\nabla\log\pi_\theta(y)\,(\log\pi_\theta(y)-\log\pi_E(y))]`
    (the sampling distribution depends on :math:`\theta`). The on-policy distillation
    *reward* form uses :math:`A_t=-\mathrm{sg}[k_{1,t}]` as a per-token advantage in a
    policy-gradient loss :math:`-A_t\log\pi_\theta(y_t)`; that estimator's expectation
    *is* the reverse-KL gradient (of one token position, with the future-prefix terms
    dropped). Use :func:`reverse_kl_distill_loss` for the exact objective.

    Args:
      student_logp: ``[B, L]`` log-probs of the sampled tokens under the student (attached).
      teacher_logp: ``[B, L]`` teacher log-probs of the same tokens (detached here).
      mask: ``[B, L]`` 0/1 action mask.
      aggregation, constant, denominator: see :func:`trajgrad.aggregate.aggregate`;
        default ``token_mean`` as for the exact loss.

    Returns:
      ``LossResult(loss, metrics)``; metrics: ``sampled_kl`` (mean :math:`k_1` per valid
      token), ``token_count``.
    """
    student_logp = _checks.as_tensor("student_logp", student_logp)
    _checks.check_ndim("student_logp", student_logp, 2)
    _checks.check_floating("student_logp", student_logp)
    mask = _checks.check_mask("mask", mask, student_logp.shape)
    _checks.check_choice("aggregation", aggregation, MODES)
    logp = _checks.per_token("student_logp", student_logp, student_logp.shape, mask)
    teacher = _checks.per_token("teacher_logp", _checks.as_tensor("teacher_logp", teacher_logp).detach(),
                                student_logp.shape, mask)
    k1 = _checks.fill_masked(logp - teacher, mask)
    loss = aggregate(k1, mask, aggregation, constant=constant, denominator=denominator)
    count = mask.sum()
    metrics = {
        "sampled_kl": (k1.detach().sum() / count.clamp_min(1)).to(k1.dtype),
        "token_count": count.to(k1.dtype),
    }
    return LossResult(loss, metrics)


# ----------------------------------------------------------------------------------------
# multiple teachers
# ----------------------------------------------------------------------------------------


def _teacher_head(i: int, spec, mask: torch.Tensor) -> Head:
    name = f"teachers[{i}]"
    if isinstance(spec, torch.Tensor):
        return _make_head(name, None, None, None, spec, None, None, None, mask, detach=True)
    if isinstance(spec, (tuple, list)) and len(spec) in (2, 3):
        hidden, weight = spec[0], spec[1]
        bias = spec[2] if len(spec) == 3 else None
        return _make_head(None, f"{name}.hidden", f"{name}.weight", f"{name}.bias", None, hidden, weight, bias,
                          mask, detach=True)
    raise ValueError(f"{name}: expected teacher logits [B, L, V] or a (hidden, weight[, bias]) tuple, "
                     f"got {type(spec).__name__}")


def _apply_token_map(i: int, teacher: Head, token_map, student_vocab: int) -> Head:
    name = f"token_maps[{i}]"
    token_map = _checks.as_tensor(name, token_map)
    if token_map.is_floating_point() or token_map.dtype == torch.bool or token_map.is_complex():
        raise ValueError(f"{name}: expected an integer tensor of teacher token ids, got dtype {token_map.dtype}")
    _checks.check_shape(name, token_map, (student_vocab,))
    token_map = token_map.to(device=teacher.x.device, dtype=torch.long)
    if token_map.numel() and bool(((token_map < 0) | (token_map >= teacher.vocab)).any()):
        raise ValueError(f"{name}: teacher token ids must lie in [0, {teacher.vocab})")
    if teacher.weight is None:
        return Head(teacher.x.index_select(1, token_map))
    bias = None if teacher.bias is None else teacher.bias.index_select(0, token_map)
    return Head(teacher.x, teacher.weight.index_select(0, token_map), bias)


def _teacher_weights(weights, routing, teachers: List[Head], mask, rows, entropy_temperature, temperature,
                     chunk_size, dtype) -> torch.Tensor:
    """Per-position teacher weights ``[n, M]`` (rows sum to 1)."""
    M = len(teachers)
    n = rows.numel()
    device = mask.device
    if routing is not None:
        if weights is not None:
            raise ValueError("routing: cannot be combined with weights (routing already sets a one-hot "
                             "weight per token); pass one of them")
        routing = _checks.as_tensor("routing", routing)
        if routing.is_floating_point() or routing.dtype == torch.bool or routing.is_complex():
            raise ValueError(f"routing: expected an integer tensor of teacher ids, got dtype {routing.dtype}")
        _checks.check_shape("routing", routing, mask.shape, against="mask")
        ids = routing.reshape(-1).to(device=device, dtype=torch.long).index_select(0, rows)
        if n and bool(((ids < 0) | (ids >= M)).any()):
            raise ValueError(f"routing: teacher ids must lie in [0, {M}) at valid positions")
        return torch.nn.functional.one_hot(ids, M).to(dtype)
    if weights is None:
        return torch.full((n, M), 1.0 / M, dtype=dtype, device=device)
    if isinstance(weights, str):
        if weights != "entropy":
            raise ValueError(f"weights: must be None, a [M] tensor or 'entropy', got {weights!r}")
        _checks.check_positive("entropy_temperature", float(entropy_temperature))
        ent = torch.stack([head_entropy(t, rows, temperature=temperature, chunk_size=chunk_size).to(dtype)
                           for t in teachers], dim=1) if n else torch.zeros(0, M, dtype=dtype, device=device)
        return torch.softmax(-ent / float(entropy_temperature), dim=1)
    w = _checks.as_tensor("weights", weights).detach()
    _checks.check_floating("weights", w)
    _checks.check_shape("weights", w, (M,))
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights: must be finite and non-negative")
    if not bool(w.sum() > 0):
        raise ValueError("weights: must have a positive sum")
    w = (w / w.sum()).to(device=device, dtype=dtype)
    return w[None, :].expand(n, M)


def multi_teacher_distill_loss(
    *,
    teachers: Sequence[Union[torch.Tensor, Tuple[torch.Tensor, ...]]],
    mask: torch.Tensor,
    student_logits: Optional[torch.Tensor] = None,
    student_hidden: Optional[torch.Tensor] = None,
    student_weight: Optional[torch.Tensor] = None,
    student_bias: Optional[torch.Tensor] = None,
    weights: Union[None, str, torch.Tensor, Sequence[float]] = None,
    routing: Optional[torch.Tensor] = None,
    token_maps: Optional[Sequence[Optional[torch.Tensor]]] = None,
    entropy_temperature: float = 1.0,
    temperature: float = 1.0,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
    chunk_size: int = 1024,
    disagreement: bool = True,
) -> LossResult:
    r"""Multi-teacher on-policy distillation, exact reverse KL to each teacher (§15).

    .. math::

       D_n = \sum_{i=1}^{M} w_i(h_n)\,\mathrm{KL}\big(\pi_\theta(\cdot|h_n)\,\Vert\,\pi_{E_i}(\cdot|h_n)\big),
       \qquad \sum_i w_i(h_n) = 1,\qquad \mathcal L = \mathrm{aggregate}(D, \text{mask})

    §15 asks how the weights are chosen; each answer is an argument:

    * ``weights=None``: uniform :math:`w_i = 1/M`.
    * ``weights`` a ``[M]`` tensor (or sequence): fixed, non-negative, renormalized to sum 1.
    * ``weights="entropy"``: confidence weighting per position,
      :math:`w_i(h) = \operatorname{softmax}_i(-\mathcal H(\pi_{E_i}(\cdot|h))/\tau)` with
      :math:`\tau` = ``entropy_temperature``: the lower a teacher's entropy at this prefix,
      the larger its weight (:math:`\tau\to0` picks the most confident teacher,
      :math:`\tau\to\infty` is uniform). The entropies are of the teacher distributions as
      used in the KL (after ``temperature`` and any token map) and are detached; it costs
      one extra pass over each teacher head.
    * ``routing``: ``[B, L]`` integer teacher id per token (task routing); the weight is
      one-hot. Each teacher's head is evaluated only at the positions routed to it.
      ``routing`` and ``weights`` are exclusive.

    **Vocabularies.** A teacher's vocabulary must equal the student's, or ``token_maps[i]``
    must be given: a LongTensor ``[V_student]`` whose entry ``v`` is the *teacher* token id
    of student token ``v``. The teacher distribution is then pulled back onto the student
    vocabulary, :math:`\tilde\pi_{E_i}(v)\propto\pi_{E_i}(\mathrm{map}[v])` (logits gathered
    and renormalized over the mapped ids; for a hidden-state teacher, the rows of its head
    are gathered). Teacher tokens that no student token maps to are dropped. Otherwise a
    ``ValueError`` names ``teachers``.

    Args:
      teachers: sequence of ``M >= 1`` teachers, each logits ``[B, L, V_i]`` or a tuple
        ``(hidden [B, L, H_i], weight [V_i, H_i][, bias [V_i]])`` (detached).
      mask: ``[B, L]`` 0/1 action mask (student-visited positions).
      student_logits or student_hidden + student_weight (+ student_bias): the student, as
        in :func:`reverse_kl_distill_loss`.
      weights, routing, entropy_temperature: the teacher weights (above).
      token_maps: ``None`` or a sequence of ``M`` entries, each ``None`` or ``[V_student]``.
      temperature, aggregation, constant, denominator, chunk_size: as in
        :func:`reverse_kl_distill_loss` (default ``token_mean``).
      disagreement: compute the teacher-disagreement metric (one extra no-grad pass per
        teacher pair).

    Returns:
      ``LossResult(loss, metrics)``; metrics (detached): ``reverse_kl`` (mean weighted KL
      :math:`D_n` per valid token), ``kl/teacher{i}`` (mean KL to teacher ``i`` over the
      positions where its weight is positive), ``weight/teacher{i}`` (mean weight),
      ``teacher_disagreement`` (mean over teacher pairs and valid positions of the
      symmetric JS divergence between the teachers, in nats, ``<= log 2``; 0 for one
      teacher), ``weight_entropy`` (mean :math:`-\sum_i w_i\log w_i`), ``student_entropy``,
      ``token_count``.

    Raises:
      ValueError naming the argument (``teachers`` for an empty list or a vocabulary
      mismatch without a map, ``token_maps``, ``weights``, ``routing``, ...).
    """
    mask = _check_mask(mask)
    _common_checks(temperature, chunk_size, aggregation)
    student = _side("student", student_logits, student_hidden, student_weight, student_bias, mask, detach=False)
    if isinstance(teachers, torch.Tensor) or not isinstance(teachers, Sequence) or isinstance(teachers, str):
        raise ValueError("teachers: expected a sequence of teachers (logits or (hidden, weight) tuples)")
    if len(teachers) == 0:
        raise ValueError("teachers: empty; give at least one teacher")
    heads = [_teacher_head(i, t, mask) for i, t in enumerate(teachers)]
    M = len(heads)
    if token_maps is not None:
        if isinstance(token_maps, torch.Tensor) or not isinstance(token_maps, Sequence) or len(token_maps) != M:
            raise ValueError(f"token_maps: expected a sequence of {M} entries (None or [V_student] ids), "
                             f"one per teacher")
    for i in range(M):
        tmap = None if token_maps is None else token_maps[i]
        if tmap is not None:
            heads[i] = _apply_token_map(i, heads[i], tmap, student.vocab)
        elif heads[i].vocab != student.vocab:
            raise ValueError(f"teachers: teacher {i} has a vocabulary of {heads[i].vocab} tokens but the student "
                             f"has {student.vocab}; pass token_maps[{i}] ([V_student] teacher ids)")
    dtype = student.x.dtype if student.x.dtype in (torch.float32, torch.float64) else torch.float32
    omega = _token_weights(mask, aggregation, constant, denominator, dtype, student.x.device)
    rows = mask.reshape(-1).nonzero().squeeze(1)
    n = rows.numel()
    w = _teacher_weights(weights, routing, heads, mask, rows, entropy_temperature, temperature, chunk_size, dtype)
    om = omega.reshape(-1).index_select(0, rows)

    jobs, selections = [], []
    for i, head in enumerate(heads):
        sel = (w[:, i] > 0).nonzero().squeeze(1)
        selections.append(sel)
        jobs.append((head, rows.index_select(0, sel), om.index_select(0, sel) * w.index_select(0, sel)[:, i]))
    loss, divs, ents_s, _ = weighted_divergence(student, jobs, kind="reverse_kl", temperature=temperature,
                                                chunk_size=chunk_size)

    per_pos = torch.zeros(n, dtype=dtype, device=rows.device)
    ent_s = torch.zeros(n, dtype=dtype, device=rows.device)
    metrics: Dict[str, torch.Tensor] = {}
    for i, (sel, div, es) in enumerate(zip(selections, divs, ents_s)):
        per_pos.index_add_(0, sel, div.to(dtype) * w.index_select(0, sel)[:, i])
        ent_s.index_copy_(0, sel, es.to(dtype))
        metrics[f"kl/teacher{i}"] = _mean(div.to(dtype))
        metrics[f"weight/teacher{i}"] = _mean(w[:, i])
    metrics["reverse_kl"] = _mean(per_pos)
    metrics["student_entropy"] = _mean(ent_s)
    plogp = torch.where(w > 0, w * torch.log(torch.where(w > 0, w, torch.ones_like(w))), torch.zeros_like(w))
    metrics["weight_entropy"] = _mean(-plogp.sum(1)) if n else torch.zeros((), dtype=dtype)
    dis = torch.zeros((), dtype=dtype, device=rows.device)
    if disagreement and M > 1 and n:
        pairs = 0
        with torch.no_grad():
            for i in range(M):
                for j in range(i + 1, M):
                    _, (js,), _, _ = weighted_divergence(
                        heads[i], [(heads[j], rows, torch.zeros(n, dtype=dtype, device=rows.device))],
                        kind="jsd", beta=0.5, normalized=False, temperature=temperature, chunk_size=chunk_size)
                    dis = dis + _mean(js.to(dtype))
                    pairs += 1
        dis = dis / pairs
    metrics["teacher_disagreement"] = dis
    metrics["token_count"] = torch.tensor(float(n), dtype=dtype, device=rows.device)
    return LossResult(loss, {k: v.detach() for k, v in metrics.items()})
