r"""Multi-teacher on-policy distillation (§15): exact reverse (or forward) KL to each teacher, weighted per position.

:func:`multi_teacher_distill_loss` is also the ``multi_teacher`` distillation term of a recipe
(``recipe.overrides.loss: multi_teacher``): the KL direction and the zero-sum rule are the recipe
fields ``teacher_direction`` and ``teacher_zero_sum`` (``explain`` prints them), the teachers
(and their weights, routing, token maps) are batch inputs of
:meth:`trajgrad.objective.Objective.distill_loss` (``teachers=[...]``). The trainer builds one
teacher: a training config naming this term is refused at load time.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _checks
from ..fused import Head, head_entropy, weighted_divergence
from ..registry import Param, policy_term
from ..types import LossResult
from ._distill_inputs import Number, _check_mask, _common_checks, _make_head, _mean, _side, _token_weights

__all__ = ["multi_teacher_distill_loss", "normalized_teacher_weights", "DIRECTIONS", "ZERO_SUM"]

DIRECTIONS = ("reverse", "forward")
ZERO_SUM = ("error", "zero")

_DIRECTION = Param("teacher_direction", "reverse", "the ``multi_teacher`` term's KL per teacher (§15): ``\"reverse\"`` "
                   "KL(π_θ‖π_E_i) (mode seeking) or ``\"forward\"`` KL(π_E_i‖π_θ) (mass covering).", str,
                   lambda v: _checks.check_choice("teacher_direction", v, DIRECTIONS))
_ZERO_SUM = Param("teacher_zero_sum", "error", "the ``multi_teacher`` term at a valid position whose teacher weights "
                  "sum to 0: ``\"error\"`` (a ValueError naming ``weights``) or ``\"zero\"`` (its renormalized weights "
                  "are 0: it contributes 0 and stays in the denominator).", str,
                  lambda v: _checks.check_choice("teacher_zero_sum", v, ZERO_SUM))
# inputs the recipe sets from its fields (refused as batch inputs: printed = optimized)
_FROM_FIELDS = {"direction": "teacher_direction", "zero_sum": "teacher_zero_sum",
                "renormalize": "the term (it always renormalizes; call multi_teacher_distill_loss for renormalize=False)"}
_SINGLE = ("teacher_logits", "teacher_hidden", "teacher_weight", "teacher_bias")


def _recipe_call(o, inputs):
    """The ``multi_teacher`` term: the batch's inputs checked once, the recipe's fields passed as arguments."""
    for k, field in _FROM_FIELDS.items():
        if k in inputs:
            raise ValueError(f"{k}: set by the recipe ({field}), not a batch input")
    single = [k for k in _SINGLE if inputs.get(k) is not None]
    if "teachers" not in inputs:
        got = f"; got {', '.join(single)} (one teacher's inputs)" if single else ""
        raise ValueError(f"teachers: required by loss {o.loss!r} (a sequence of teachers: logits [B, L, V] or "
                         f"(hidden, weight[, bias]) tuples){got}")
    if single:
        raise ValueError(f"{single[0]}: not an input of loss {o.loss!r}; give every teacher in teachers")
    return multi_teacher_distill_loss(direction=o.teacher_direction, zero_sum=o.teacher_zero_sum, **inputs)


def _recipe_text(o) -> str:
    kl = ("KL(π_θ(·|h_t) ‖ sg[π_E_i(·|h_t)])   (reverse KL per teacher, mode seeking)" if o.teacher_direction == "reverse"
          else "KL(sg[π_E_i(·|h_t)] ‖ π_θ(·|h_t))   (forward KL per teacher, mass covering)")
    zero = ("a valid position whose weights sum to 0 is an error (teacher_zero_sum 'error')"
            if o.teacher_zero_sum == "error" else
            "a valid position whose weights sum to 0 gets w̃ = 0: it contributes 0 and stays in the denominator "
            "(teacher_zero_sum 'zero')")
    return (f"x_t = Σ_i w̃_i(h_t) · {kl}\n"
            "    exact over the full vocabulary, M teachers (a batch input), §15\n"
            "    w̃_i(h) = w_i(h) / Σ_j w_j(h): the weights given with the batch (uniform 1/M when none; fixed, "
            "entropy, routed or learned)\n"
            f"    {zero}")


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


def _routing_weights(routing, weights, M, mask, rows, dtype) -> torch.Tensor:
    if weights is not None:
        raise ValueError("routing: cannot be combined with weights (routing already sets a one-hot "
                         "weight per token); pass one of them")
    routing = _checks.as_tensor("routing", routing)
    if routing.is_floating_point() or routing.dtype == torch.bool or routing.is_complex():
        raise ValueError(f"routing: expected an integer tensor of teacher ids, got dtype {routing.dtype}")
    _checks.check_shape("routing", routing, mask.shape, against="mask")
    ids = routing.reshape(-1).to(device=mask.device, dtype=torch.long).index_select(0, rows)
    if rows.numel() and bool(((ids < 0) | (ids >= M)).any()):
        raise ValueError(f"routing: teacher ids must lie in [0, {M}) at valid positions")
    return torch.nn.functional.one_hot(ids, M).to(dtype)


def _positional_weights(w: torch.Tensor, M: int, mask, rows, renormalize: bool, dtype, name: str,
                        zero_sum: str = "error") -> torch.Tensor:
    """``[M, B, L]`` weights -> ``[n, M]`` at the valid rows (attached), validated and renormalized
    (:func:`normalized_teacher_weights`)."""
    _checks.check_floating(name, w)
    _checks.check_shape(name, w, (M,) + tuple(mask.shape), against="(number of teachers,) + mask")
    w = w.reshape(M, -1).index_select(1, rows).T.to(dtype)          # masked slots are never read
    if _checks.values_checked() and rows.numel():
        wd = w.detach()
        if not bool(torch.isfinite(wd).all()):
            raise ValueError(f"{name}: contains NaN or inf at a valid (mask=1) position")
        if bool((wd < 0).any()):
            raise ValueError(f"{name}: must be non-negative at valid positions")
        if renormalize and zero_sum == "error" and not bool((wd.sum(1) > 0).all()):
            raise ValueError(f"{name}: the weights of the teachers sum to 0 at a valid position; they cannot be "
                             f"renormalized (pass renormalize=False, zero_sum='zero' or positive weights)")
    return _renormalize(w, zero_sum) if renormalize else w


def _renormalize(w: torch.Tensor, zero_sum: str) -> torch.Tensor:
    """``[n, M]`` -> divided by each row's sum; a zero-sum row stays 0 (``zero_sum="zero"``)."""
    total = w.sum(1, keepdim=True)
    if zero_sum == "error":
        return w / total
    positive = total > 0
    return torch.where(positive, w / torch.where(positive, total, torch.ones_like(total)), torch.zeros_like(w))


def normalized_teacher_weights(weights: torch.Tensor, mask: torch.Tensor, *, renormalize: bool = True,
                               zero_sum: str = "error") -> torch.Tensor:
    r"""The per-position teacher weights :func:`multi_teacher_distill_loss` uses, ``[M, B, L]``.

    .. math:: \tilde w_i(h)=\frac{w_i(h)}{\sum_jw_j(h)}\quad(\texttt{renormalize}),\qquad
        \tilde w_i(h)=0\ \text{where}\ \textstyle\sum_jw_j(h)=0\ (\texttt{zero\_sum="zero"}),

    at valid positions (0 at masked ones; NaN allowed there). Weights must be finite and
    non-negative at valid positions; a zero sum is a ``ValueError`` naming ``weights``
    unless ``zero_sum="zero"`` (that position then contributes 0 to the loss and stays in
    its denominator). Attached when ``weights`` is (the gradient flows through the
    division). Worked example, two teachers at two positions, :math:`w=((1, 0), (3, 0))`
    (teacher-major, ``[M, B=1, L=2]``): :math:`\tilde w=((0.25, 0), (0.75, 0))` with
    ``zero_sum="zero"``, an error by default.

    Args:
      weights: ``[M, B, L]`` non-negative weights. mask: ``[B, L]`` action mask.
      renormalize: divide by the per-position sum (default) or return them as given.
      zero_sum: ``"error"`` (default) or ``"zero"``.
    """
    _checks.check_choice("zero_sum", zero_sum, ZERO_SUM)
    mask = _check_mask(mask)
    w = _checks.as_tensor("weights", weights)
    if w.ndim != 3:
        raise ValueError(f"weights: expected [M, B, L] per-position weights, got shape {tuple(w.shape)}")
    rows = mask.reshape(-1).nonzero().squeeze(1)
    dtype = w.dtype if w.dtype in (torch.float32, torch.float64) else torch.float32
    got = _positional_weights(w, w.shape[0], mask, rows, bool(renormalize), dtype, "weights", zero_sum)  # [n, M]
    out = torch.zeros((w.shape[0], mask.numel()), dtype=dtype, device=mask.device)
    out = out.index_copy(1, rows, got.T)
    return out.reshape((w.shape[0],) + tuple(mask.shape))


def _teacher_weights(weights, routing, teachers: List[Head], mask, rows, entropy_temperature, temperature,
                     chunk_size, dtype, renormalize, router_input, student_hidden, zero_sum="error") -> torch.Tensor:
    """Per-position teacher weights ``[n, M]``; attached only for learned ``[M, B, L]`` weights."""
    M = len(teachers)
    n = rows.numel()
    device = mask.device
    if router_input is not None and (not callable(weights) or isinstance(weights, torch.Tensor)):
        raise ValueError("router_input: only used when weights is a router (a callable such as TeacherRouter)")
    if routing is not None:
        return _routing_weights(routing, weights, M, mask, rows, dtype)
    if weights is None:
        return torch.full((n, M), 1.0 / M, dtype=dtype, device=device)
    if isinstance(weights, str):
        if weights != "entropy":
            raise ValueError(f"weights: must be None, 'entropy', a [M] or [M, B, L] tensor or a router, "
                             f"got {weights!r}")
        _checks.check_positive("entropy_temperature", float(entropy_temperature))
        ent = torch.stack([head_entropy(t, rows, temperature=temperature, chunk_size=chunk_size).to(dtype)
                           for t in teachers], dim=1) if n else torch.zeros(0, M, dtype=dtype, device=device)
        return torch.softmax(-ent / float(entropy_temperature), dim=1)
    if callable(weights) and not isinstance(weights, torch.Tensor):
        if router_input is None:
            if student_hidden is None:
                raise ValueError("router_input: required when weights is a router and the student is given as "
                                 "logits (the router reads [B, L, H] features)")
            router_input = student_hidden.detach()
        router_input = _checks.as_tensor("router_input", router_input)
        if router_input.ndim != 3 or tuple(router_input.shape[:2]) != tuple(mask.shape):
            raise ValueError(f"router_input: expected shape {tuple(mask.shape)} + (H,), got {tuple(router_input.shape)}")
        # masked rows replaced by selection: NaN there cannot reach the router's gradient
        router_input = torch.where(mask[..., None], router_input,
                                   torch.zeros((), dtype=router_input.dtype, device=router_input.device))
        out = weights(router_input)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"weights: the router returned {type(out).__name__}, expected a [M, B, L] tensor")
        return _positional_weights(out, M, mask, rows, renormalize, dtype, "weights (router output)", zero_sum)
    w = _checks.as_tensor("weights", weights)
    if w.ndim == 3:
        return _positional_weights(w, M, mask, rows, renormalize, dtype, "weights", zero_sum)
    w = w.detach()
    _checks.check_floating("weights", w)
    if w.shape != (M,):
        raise ValueError(f"weights: expected shape ({M},) (one fixed weight per teacher) or ({M}, {mask.shape[0]}, "
                         f"{mask.shape[1]}) (per position), got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights: must be finite and non-negative")
    if renormalize and zero_sum == "error" and not bool(w.sum() > 0):
        raise ValueError("weights: must have a positive sum")
    w = (_renormalize(w[None], zero_sum)[0] if renormalize else w).to(device=device, dtype=dtype)
    return w[None, :].expand(n, M)


@policy_term(
    "multi_teacher", fields=("teacher_direction", "teacher_zero_sum"), ratio="none",
    detached=("teacher distributions", "fixed, entropy and routed teacher weights"), aggregation="token_mean",
    kind="distill", text=_recipe_text, params=(_DIRECTION, _ZERO_SUM), inputs=("teachers",), call=_recipe_call,
)
def multi_teacher_distill_loss(
    *,
    teachers: Sequence[Union[torch.Tensor, Tuple[torch.Tensor, ...]]],
    mask: torch.Tensor,
    student_logits: Optional[torch.Tensor] = None,
    student_hidden: Optional[torch.Tensor] = None,
    student_weight: Optional[torch.Tensor] = None,
    student_bias: Optional[torch.Tensor] = None,
    weights: Union[None, str, torch.Tensor, Sequence[float], Callable[[torch.Tensor], torch.Tensor]] = None,
    routing: Optional[torch.Tensor] = None,
    renormalize: bool = True,
    router_input: Optional[torch.Tensor] = None,
    token_maps: Optional[Sequence[Optional[torch.Tensor]]] = None,
    entropy_temperature: float = 1.0,
    temperature: float = 1.0,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
    chunk_size: Union[int, str] = "auto",
    disagreement: bool = True,
    direction: str = "reverse",
    zero_sum: str = "error",
) -> LossResult:
    r"""Multi-teacher on-policy distillation, exact reverse (or forward) KL to each teacher (§15).

    .. math::

       D_n = \sum_{i=1}^{M} w_i(h_n)\,\mathrm{KL}\big(\pi_\theta(\cdot|h_n)\,\Vert\,\pi_{E_i}(\cdot|h_n)\big),
       \qquad \mathcal L = \mathrm{aggregate}(D, \text{mask}) = \sum_n \omega_n D_n

    with :math:`\sum_i w_i(h_n) = 1` unless ``renormalize=False``. The gradient w.r.t. the
    student logits is the weighted sum of each teacher's reverse-KL gradient,
    :math:`\partial D_n/\partial z_{n,v} = \sum_i w_i(h_n)\,\pi_\theta(v)[\log\pi_\theta(v)-\log\pi_{E_i}(v)-\mathrm{KL}_i]/T`
    (every teacher that weighs a position contributes to its gradient).

    ``direction="forward"`` puts the forward KL in place of the reverse one,
    :math:`D_n=\sum_iw_i(h_n)\,\mathrm{KL}(\pi_{E_i}\Vert\pi_\theta)` (gradient
    :math:`\sum_iw_i(\pi_\theta-\pi_{E_i})/T`; the metric is then ``forward_kl``).
    ``zero_sum="zero"``: a valid position whose weights sum to 0 gets weights 0 under
    ``renormalize`` (its contribution is 0, it stays in the denominator) instead of the
    error (:func:`normalized_teacher_weights`). Worked example, one position, one teacher,
    student logits :math:`(0, 0)`, teacher :math:`(\log 3, 0)`: reverse KL
    :math:`0.5\log\frac{0.5}{0.75}+0.5\log\frac{0.5}{0.25}=0.143841`, gradient
    :math:`(-0.274653, 0.274653)`; forward KL :math:`0.75\log1.5+0.25\log0.5=0.130812`,
    gradient :math:`(-0.25, 0.25)`. Zero-sum worked example: that position twice (``[B=1, L=2]``), one
    teacher with per-position weights :math:`((1, 0))` (``[M=1, B, L]``), ``zero_sum="zero"``,
    ``token_mean``: the second position's weight sum is 0, so :math:`\tilde w=(1, 0)` and the loss is
    :math:`(0.143841+0)/2=0.071921` (reverse; forward :math:`0.130812/2=0.065406`), gradient
    :math:`(-0.137327, 0.137327)` (reverse; forward :math:`(-0.125, 0.125)`) at the first position
    and 0 at the second; ``zero_sum="error"`` raises.

    §15 asks how the weights are chosen; each answer is an argument:

    * ``weights=None``: uniform :math:`w_i = 1/M`.
    * ``weights`` a ``[M]`` tensor (or sequence): fixed, non-negative, renormalized to sum 1
      (used as given with ``renormalize=False``); constants (detached).
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
    * ``weights`` a ``[M, B, L]`` tensor: per-position weights :math:`w_i(h)`, the
      *learned* option (e.g. the output of a router network). Values at masked positions
      are never read (NaN allowed); at valid positions they must be finite and
      non-negative. ``renormalize=True`` (default) divides them by
      :math:`\sum_j w_j(h)` at each position (which must then be positive), so the loss is
      a convex combination of the KLs; ``renormalize=False`` uses them as given (e.g.
      independent sigmoid gates).
      **Gradient into the weights:** a tensor that requires grad is *attached*: the loss
      passes :math:`\partial\mathcal L/\partial w_i(h_n) = \omega_n\,\mathrm{KL}_i(h_n)`
      to it (through the renormalization when on), with the KLs detached; every teacher is
      then evaluated at every valid position, since a zero weight still has a gradient.
      Minimizing this loss alone moves the weight onto the teacher currently closest to
      the student (the smallest KL); to train the weights by another criterion, pass
      ``weights.detach()`` (the student's gradient is the same either way).
    * ``weights`` a callable (such as :class:`~trajgrad.losses.teacher_router.TeacherRouter`):
      the router, called as ``weights(router_input)`` and returning ``[M, B, L]``, then
      treated as above (attached: its parameters receive the gradient).
      ``router_input`` defaults to ``student_hidden.detach()``: the router reads the
      student's features but its gradient never reaches them, so the student is trained by
      the KL terms only. Pass ``router_input`` explicitly (required with
      ``student_logits``) to route on other features, attached or not. Features at masked
      positions are replaced by 0 (by selection) before the router sees them.

    What is detached: all teacher outputs; fixed, entropy and routed weights. Attached: the
    student, and learned ``[M, B, L]`` weights / router parameters that require grad.

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
      weights, routing, entropy_temperature, renormalize, router_input: the teacher
        weights (above).
      token_maps: ``None`` or a sequence of ``M`` entries, each ``None`` or ``[V_student]``.
      temperature, aggregation, constant, denominator, chunk_size: as in
        :func:`reverse_kl_distill_loss` (default ``token_mean``).
      disagreement: compute the teacher-disagreement metric (one extra no-grad pass per
        teacher pair).
      direction: ``"reverse"`` (default) or ``"forward"`` KL per teacher.
      zero_sum: ``"error"`` (default) or ``"zero"`` for zero-sum weights under ``renormalize``.

    Returns:
      ``LossResult(loss, metrics)``; metrics (detached): ``reverse_kl`` (mean weighted KL
      :math:`D_n` per valid token), ``kl/teacher{i}`` (mean KL to teacher ``i`` over the
      positions where its weight is positive, all valid positions for learned weights),
      ``weight/teacher{i}`` (mean weight),
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
    _checks.check_choice("direction", direction, DIRECTIONS)
    _checks.check_choice("zero_sum", zero_sum, ZERO_SUM)
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
    w_attached = _teacher_weights(weights, routing, heads, mask, rows, entropy_temperature, temperature, chunk_size,
                                  dtype, bool(renormalize), router_input, student_hidden, zero_sum)
    learned = w_attached.requires_grad and torch.is_grad_enabled()
    w = w_attached.detach()
    om = omega.reshape(-1).index_select(0, rows)

    jobs, selections = [], []
    everywhere = torch.arange(n, device=rows.device)
    for i, head in enumerate(heads):
        sel = everywhere if learned else (w[:, i] > 0).nonzero().squeeze(1)
        selections.append(sel)
        jobs.append((head, rows.index_select(0, sel), om.index_select(0, sel) * w.index_select(0, sel)[:, i]))
    loss, divs, ents_s, _ = weighted_divergence(student, jobs, kind=f"{direction}_kl", temperature=temperature,
                                                chunk_size=chunk_size)
    if learned:   # + sum_i sum_n omega_n (w - sg[w]) sg[KL_i]: value unchanged (exactly 0), d/dw = omega KL
        for i, div in enumerate(divs):
            dw = w_attached[:, i] - w[:, i]
            loss = loss + torch.dot(om * dw, div.detach().to(dtype)).to(loss.dtype)

    per_pos = torch.zeros(n, dtype=dtype, device=rows.device)
    ent_s = torch.zeros(n, dtype=dtype, device=rows.device)
    metrics: Dict[str, torch.Tensor] = {}
    for i, (sel, div, es) in enumerate(zip(selections, divs, ents_s)):
        per_pos.index_add_(0, sel, div.to(dtype) * w.index_select(0, sel)[:, i])
        ent_s.index_copy_(0, sel, es.to(dtype))
        metrics[f"kl/teacher{i}"] = _mean(div.to(dtype))
        metrics[f"weight/teacher{i}"] = _mean(w[:, i])
    metrics[f"{direction}_kl"] = _mean(per_pos)
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

