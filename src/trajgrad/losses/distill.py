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
``retain_graph=True``. ``chunk_size="auto"`` (the default) takes the largest chunk whose
temporaries fit a memory budget (192 MiB unless overridden;
:mod:`trajgrad.fused.chunking`), which at ``V = 151,936, L = 2,048`` keeps the net peak
memory more than 10x below the naive path's (measured in ``bench/results/distill.md``).

**Modules.** Single-teacher losses here; :mod:`~trajgrad.losses.multi_teacher` (§15, with
:class:`~trajgrad.losses.teacher_router.TeacherRouter` for learned weights),
:mod:`~trajgrad.losses.sampled_kl` (the sampled-token approximation); all names are
importable from this module too.

**Detached.** Everything of the teacher (logits, hidden states, head). Gradients flow to
the student logits, or to the student hidden states, head weight and bias.

**Aggregation.** Default ``token_mean``: §14's exact code ends with
``masked_mean(reverse_kl, action_mask)``, i.e. every student token weighs the same, as in
the on-policy distillation papers (GKD, Agarwal et al. 2024; MiniLLM, Gu et al. 2024).

**Temperature.** Both distributions are :math:`\operatorname{softmax}(z/T)` with the same
``temperature``.
"""
from __future__ import annotations

from typing import Dict, Optional, Union

import torch

from .. import _checks
from ..fused import weighted_divergence
from ..registry import Param, finite_positive, policy_term
from ..types import LossResult
from ._distill_inputs import Number, _check_mask, _common_checks, _mean, _side, _token_weights, _vocab_match
from .multi_teacher import multi_teacher_distill_loss
from .sampled_kl import sampled_token_kl

__all__ = [
    "reverse_kl_distill_loss",
    "forward_kl_distill_loss",
    "jsd_distill_loss",
    "sampled_token_kl",
    "multi_teacher_distill_loss",
]


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


@policy_term(
    "opd", fields=(), ratio="none", detached=("teacher distribution",), aggregation="token_mean", kind="distill",
    text=lambda o: ("x_t = Σ_v π_θ(v|h_t) [log π_θ(v|h_t) − sg[log π_E(v|h_t)]]   (exact reverse KL over the full "
                    "vocabulary, §14;\n    not the sampled-token approximation)"),
)
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
    chunk_size: Union[int, str] = "auto",
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
      chunk_size: positions per chunk, or ``"auto"`` (default): the largest chunk whose
        ``2 * chunk_size * V`` float temporaries fit the memory budget of
        :mod:`trajgrad.fused.chunking` (192 MiB unless overridden with
        :func:`trajgrad.fused.chunk_budget` or ``TRAJGRAD_CHUNK_BUDGET_MIB``; 160 positions
        at ``V = 151,936``).

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
    chunk_size: Union[int, str] = "auto",
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


_JSD_DOC = ("the generalized JSD(β) distillation term (``generalized_jsd``; §14): the teacher's weight in the "
            "mixture, and how the ends are read — ``\"kl_at_ends\"`` (TRL's ``generalized_jsd_loss``: JSD(β) for "
            "0 < β < 1, forward KL at β = 0, reverse KL at 1), ``\"normalized\"`` (JSD(β)/(β(1−β)), continuous on "
            "[0, 1]) or ``\"unnormalized\"``.")
_JSD_NORMALIZED = {"kl_at_ends": "kl_at_ends", "normalized": True, "unnormalized": False}


def _check_jsd_beta(v) -> None:
    finite_positive("jsd_beta", v, allow_zero=True)
    _checks.check_in_range("jsd_beta", v, 0.0, 1.0)


JSD_BETA = Param("jsd_beta", 0.5, _JSD_DOC, float, _check_jsd_beta)
JSD_NORMALIZED = Param("jsd_normalized", "kl_at_ends", _JSD_DOC, str,
                       lambda v: _checks.check_choice("jsd_normalized", v, tuple(_JSD_NORMALIZED)))


def _jsd_text(o) -> str:
    b = o.jsd_beta
    ends = {"kl_at_ends": "JSD(β) itself; at β = 0 the forward KL KL(π_E‖π_θ), at β = 1 the reverse KL (TRL's convention)",
            "normalized": "JSD(β) / (β(1 − β)): continuous on [0, 1], forward KL at 0, reverse KL at 1",
            "unnormalized": "JSD(β) itself (0 at β ∈ {0, 1})"}[o.jsd_normalized]
    return (f"m = {b:g} · sg[π_E] + {1 - b:g} · π_θ   (the teacher's weight β = {b:g})\n"
            f"x_t = {b:g} · KL(sg[π_E] ‖ m) + {1 - b:g} · KL(π_θ ‖ m)   exact over the vocabulary (§14)\n"
            f"    {ends}")


@policy_term(
    "generalized_jsd", fields=("jsd_beta", "jsd_normalized"), ratio="none", detached=("teacher distribution",),
    aggregation="token_mean", kind="distill", text=_jsd_text, params=(JSD_BETA, JSD_NORMALIZED),
    call=lambda o, x: jsd_distill_loss(beta=o.jsd_beta, normalized=_JSD_NORMALIZED[o.jsd_normalized], **x),
)
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
    normalized: Union[bool, str] = True,
    temperature: float = 1.0,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
    chunk_size: Union[int, str] = "auto",
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
    * ``normalized="kl_at_ends"``: :math:`\mathrm{JSD}(\beta)` unnormalized for
      :math:`0<\beta<1`, and the KL limits at the ends: the forward KL
      :math:`\mathrm{KL}(\pi_E\Vert\pi_\theta)` at :math:`\beta=0`, the reverse KL
      :math:`\mathrm{KL}(\pi_\theta\Vert\pi_E)` at :math:`\beta=1` (discontinuous in
      :math:`\beta` there). This is the convention of TRL's ``generalized_jsd_loss``
      (GKD trainer), whose mixture is the same :math:`\beta\pi_E+(1-\beta)\pi_\theta`
      and whose per-token value is :math:`\beta\mathrm{KL}(\pi_E\Vert m)+(1-\beta)\mathrm{KL}(\pi_\theta\Vert m)`:
      with ``normalized="kl_at_ends"``, the same ``temperature`` (TRL divides both logits by
      it and applies no :math:`T^2` factor) and ``aggregation="token_mean"`` (TRL's
      ``reduction="batchmean"`` with labels: the sum over valid tokens divided by their
      count), one setting reproduces TRL at every :math:`\beta`, :math:`\{0, 0.5, 1\}`
      included.

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
      ValueError: ``beta`` outside ``[0, 1]`` (naming ``beta``), ``normalized`` not one of
      ``True``, ``False``, ``"kl_at_ends"``, and as :func:`reverse_kl_distill_loss`.
    """
    try:
        beta_f = float(beta)
    except (TypeError, ValueError):
        raise ValueError(f"beta: expected a number in [0, 1], got {beta!r}") from None
    _checks.check_in_range("beta", beta_f, 0.0, 1.0)
    if isinstance(normalized, str):
        if normalized != "kl_at_ends":
            raise ValueError(f"normalized: must be True, False or 'kl_at_ends', got {normalized!r}")
        normalized = beta_f in (0.0, 1.0)          # the KL limits at the ends, JSD(beta) inside
    elif not isinstance(normalized, (bool, int)) or normalized not in (0, 1):
        raise ValueError(f"normalized: must be True, False or 'kl_at_ends', got {normalized!r}")
    return _single_teacher(
        "jsd", beta_f, bool(normalized), "jsd", student_logits=student_logits, teacher_logits=teacher_logits,
        student_hidden=student_hidden, student_weight=student_weight, student_bias=student_bias,
        teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias, mask=mask,
        temperature=temperature, aggregation=aggregation, constant=constant, denominator=denominator,
        chunk_size=chunk_size)

