r"""Generalized Advantage Estimation over time, flat and skip-observation (spec §6, §20.4).

===============================  ===========================================================
``gae``                          :math:`\hat A_t=\delta_t+\gamma\lambda(1-d_t)\hat A_{t+1}`,
                                 :math:`\delta_t=r_t+\gamma(1-d_t)V_{t+1}-V_t` (§6)
``token_skip_observation_gae``   the same on a token transcript, observation spans bridged
``skip_observation_gae``         one entry per model action, values supplied explicitly (§20.4)
===============================  ===========================================================

The conventions of :mod:`trajgrad.advantages.returns` hold: ``[B, T]`` tensors, ``mask = 0`` steps
skipped (never terminal, output 0, their contents never reach a valid output), rewards and
values detached, no output carries a gradient. The names are re-exported by
:mod:`trajgrad.advantages.returns`.

Cost. Each function is one backward affine scan (:mod:`trajgrad.advantages._scan`, in place) plus a
fixed number of elementwise passes over ``[B, T]``: there is no Python loop over time, no
gather of the next valid step, and the flags only change the per-step coefficient of the
one scan. Padding contents are removed by selection (:class:`trajgrad.advantages._steps.Padding`: a bitwise
AND with the mask, or a tail fill per row for right padding) before anything reads them and
again from the outputs, so stored NaN/±inf never leak; the only large allocation is the
outputs' block. Finiteness of the valid inputs is checked by one reduction over the scan's
offset, which every valid input enters; the per-input checks run only when it is not
finite, to name the input (or find an overflow of finite inputs, which is not an error).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from .. import _checks
from . import _steps
from ._scan import suffix_affine_scan_
from .baselines import whiten, whiten_empty_text
from ..registry import AdvantageEstimator, Param, finite_positive, flag, register_advantage_estimator

Number = Union[float, int, torch.Tensor]

__all__ = ["GAEOutput", "gae", "token_skip_observation_gae", "skip_observation_gae"]

# From this lam up, advantages are read off the scan as (y - V) / lam, which at most doubles
# the rounding error of y; below it they are rebuilt from the continuation flags.
_DIRECT_LAM = 0.5


class GAEOutput(NamedTuple):
    """Result of :func:`gae` and :func:`token_skip_observation_gae`.

    Attributes:
      advantages: ``[B, T]`` advantage estimates, 0 at masked steps (detached).
      returns: ``[B, T]`` value targets ``advantages + values`` (the λ-return), 0 at masked
        steps (detached).
    """

    advantages: torch.Tensor
    returns: torch.Tensor


def _optional_flag(name: str, x, shape, mask: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """A 0/1 flag as bool, False at masked steps; ``None`` when not given."""
    if x is None:
        return None
    f = _checks.check_mask(name, x, shape).to(device)
    return f if mask is None else f & mask


def _last_step_carries(mask: Optional[torch.Tensor], carry: Optional[torch.Tensor], shape, device) -> torch.Tensor:
    """``[B]`` bool: the row has a valid step and its last one continues into the bootstrap."""
    bsz, length = shape
    if length == 0:
        return torch.zeros(bsz, dtype=torch.bool, device=device)
    if mask is None:
        last = torch.full((bsz,), length - 1, device=device)
        has = torch.ones(bsz, dtype=torch.bool, device=device)
    else:
        last = length - 1 - torch.argmax(mask.flip(-1).to(torch.int8), -1)
        has = mask.any(-1)
    if carry is None:
        return has
    return has & torch.gather(carry, -1, last[:, None])[:, 0]


def _right_padding_ends(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[B]`` index of each row's last valid step (-1 if none) when the padding only trails
    the valid steps of every row (then nothing has to pass through padding); else ``None``."""
    if mask is None or mask.numel() == 0:
        return None
    if mask.shape[-1] > 1 and _steps.any_true(~mask[:, :-1] & mask[:, 1:]):
        return None  # a valid step follows padding (a prompt, say, or an observation span)
    return torch.count_nonzero(mask, -1) - 1


def _gae_scan(r, v, pad, carry, ends, gamma, lam, n0, boot, check=None):
    r"""Advantages and returns from validated ``r``, ``v`` (anything at ``pad`` steps).

    The scan runs on :math:`y_t=V_t+\lambda\hat A_t` and lets padding pass the carry through
    unchanged (coefficient 1, offset 0). Writing :math:`\hat A_t=r_t-V_t+\gamma N_t`, with
    :math:`N_t=y_{t'}` when step :math:`t` carries on to the next valid step :math:`t'` and
    :math:`N_t=N^0_t` (0 or the truncation value) when it stops, gives the one affine
    recurrence

    .. math:: y_t=(1-\lambda)V_t+\lambda r_t+\lambda\gamma N^0_t+\gamma\lambda\,c_t\,y_{t+1},

    with :math:`c_t` the continuation flag (1 at padding, where the offset is 0). The
    bootstrap value is the :math:`y` after the last step of the row (padding passes it back
    to the last valid step), so the end of a row needs no location of its last valid step.
    Then :math:`\hat A_t=(y_t-V_t)/\lambda`, or for a small :math:`\lambda` (where that
    division would amplify rounding) :math:`r_t-V_t+\gamma(c_ty_{t+1}+N^0_t)`.

    ``carry`` is ``None`` when every valid step carries, and the coefficient is then the one
    number :math:`\gamma\lambda`. ``ends`` (``[B]``, -1 for an empty row) is given when the
    padding of every row only trails its valid steps: nothing then has to pass through the
    padding (its offset is 0 and nothing valid follows), and the bootstrap enters at the
    last valid step directly.

    Padding entries are replaced by selection (``pad``, a :class:`trajgrad.advantages._steps.Padding`)
    before they are read and after every step that could have carried stored NaN/inf into
    them, so nothing stored there reaches a valid output. One ``[2, B, T]`` block is
    allocated for the two outputs; the coefficients live in the advantage half until the
    scan is done.

    ``check`` (optional) runs when the offset, padding removed, is not finite. Every valid
    input enters the offset with a non-zero factor (``values`` too unless ``lam = 1``), and a
    NaN or inf among them leaves the offset non-finite, so one reduction over it replaces one
    per input; ``check`` then finds the input and raises naming it.
    """
    length = r.shape[-1]
    rate = gamma * lam
    direct = lam >= _DIRECT_LAM
    # With a direct read-off the scan runs on y / lam (the recurrence is linear), which turns
    # both the offset and the read-off into one operation each.
    scale = 1.0 / lam if direct else 1.0
    # One allocation for both outputs: the allocator hands the same block back on the next
    # call instead of returning two half-sized ones to the system (a page fault per 4 KiB).
    both = torch.empty((2,) + tuple(r.shape), dtype=r.dtype, device=r.device)
    work, y = both[0], both[1]  # coefficients then advantages; scratch, then y, then returns
    # The coefficients first, while y is free to serve as scratch.
    if carry is None:
        c: Union[float, torch.Tensor] = rate
    elif pad is not None and ends is None:
        c = pad.coefficients_(work, None if carry is pad.mask else carry, rate, scratch=y)
    else:  # no padding, or padding that nothing has to cross
        c = work.copy_(carry.view(torch.uint8) if carry.dtype == torch.bool else carry).mul_(rate)
    if n0 is None:
        if direct:
            torch.add(r, v, alpha=(1.0 - lam) / lam, out=y)  # ((1 - lam) V + lam r) / lam
        else:
            torch.lerp(v, r, lam, out=y)  # (1 - lam) V + lam r
    else:
        # truncation values, read at truncations only (a selection), then the rest of the offset
        torch.where(n0[1], n0[0], torch.zeros((), dtype=y.dtype, device=y.device), out=y)
        if direct:
            torch.add(r, y, alpha=rate * scale, out=y).add_(v, alpha=(1.0 - lam) / lam)
        else:
            y.mul_(rate).add_(r, alpha=lam).add_(v, alpha=1.0 - lam)
    if pad is not None:
        pad.zero_(y)
    if check is not None and not _steps.all_finite(y):
        check()  # a non-finite offset: find the input, raise naming it (or an overflow: go on)
    rows = idx = None
    if boot is not None and length:
        if ends is None:
            if isinstance(c, torch.Tensor):
                y[:, -1].addcmul_(c[:, -1], boot, value=scale)
            else:
                y[:, -1].add_(boot, alpha=c * scale)
        else:
            rows = torch.nonzero(ends >= 0).flatten()
            idx = ends[rows]
            at = c[rows, idx] if isinstance(c, torch.Tensor) else rate
            y.index_put_((rows, idx), at * scale * boot[rows], accumulate=True)
    suffix_affine_scan_(y, c)

    adv = work
    if direct:
        torch.sub(y, v, alpha=scale, out=adv)  # y / lam - V / lam
    else:
        # gamma * (carry * y[t + 1] + N0) + r - V
        if carry is None:
            adv.fill_(1.0)
        else:
            adv.copy_(carry)
        if length:
            if rows is not None:
                flags = adv[rows, idx]
            adv[:, :-1].mul_(y[:, 1:])
            if boot is None:
                adv[:, -1].zero_()
            else:
                adv[:, -1].mul_(boot)
            if rows is not None:
                # trailing padding does not pass the bootstrap back: it enters here
                adv[rows, idx] = flags * boot[rows]
        adv.mul_(gamma)
        if n0 is not None:
            adv.add_(_steps.select(n0[0], n0[1]), alpha=gamma)
        adv.add_(r).sub_(v)
    if pad is not None:
        pad.zero_(adv)
    ret = torch.add(adv, v, out=y)
    if pad is not None:
        pad.zero_(ret)
    return adv, ret


def _gae_core(rewards, values, mask, gamma, lam, terminated, truncated, bootstrap_value, truncation_value):
    """Shared body of :func:`gae` and :func:`token_skip_observation_gae` (validation + scan)."""
    rewards = _steps.steps("rewards", rewards)
    shape = tuple(rewards.shape)
    bsz, length = shape
    device = rewards.device
    m = None if mask is None else _checks.check_mask("mask", mask, shape).to(device)
    gamma = _steps.check_rate("gamma", gamma)
    lam = _steps.check_rate("lam", lam)
    values = _steps.as_float("values", values)
    _checks.check_shape("values", values, shape, against="rewards")
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if lam == 1.0 and not _steps.all_finite(values):
        _checks.check_finite("values", values, m)  # lam = 1: values do not enter the offset
    r, v = rewards.to(dtype), values.to(dtype)

    term = _optional_flag("terminated", terminated, shape, m, device)
    trunc = _optional_flag("truncated", truncated, shape, m, device)
    if trunc is not None and term is not None:
        trunc = trunc & ~term
    stop = None
    for flag in (term, trunc):
        if flag is not None:
            stop = flag if stop is None else stop | flag
    ends = _right_padding_ends(m)
    if stop is None:
        carry = None if (m is None or ends is not None) else m
    else:
        carry = ~stop if m is None else m & ~stop

    n0 = None  # (values, where): the next value where the carry stops at a truncation
    if truncation_value is None:
        if trunc is not None and _steps.any_true(trunc):
            raise ValueError("truncation_value: required when truncated has a 1 at a valid step")
    else:
        if truncated is None:
            raise ValueError("truncation_value: given without truncated (it is read only at truncated steps)")
        tv = _steps.as_float("truncation_value", truncation_value)
        _checks.check_shape("truncation_value", tv, shape, against="rewards")
        n0 = (tv.to(dtype=dtype, device=device), trunc)  # read at truncations only, by selection
    boot = None
    if bootstrap_value is not None:
        bv = _steps.as_float("bootstrap_value", bootstrap_value)
        if bv.ndim == 0:
            bv = bv.expand(bsz)
        _checks.check_shape("bootstrap_value", bv, (bsz,))
        boot = bv.to(dtype=dtype, device=device)
        # the scan adds bootstrap / lam when lam >= _DIRECT_LAM: there a finite value stored where
        # it is not read can overflow, and 0 * inf would reach the row's valid steps
        if not _steps.all_finite(boot / lam if lam >= _DIRECT_LAM else boot):
            # read only where the last valid step of a row continues into it
            read = _last_step_carries(m, carry, shape, device)
            _checks.check_finite("bootstrap_value", boot, read)
            boot = _checks.fill_masked(boot, read)

    def check():  # the finiteness checks, in argument order, when the offset is not finite
        _checks.check_finite("rewards", rewards, m)
        _checks.check_finite("values", values, m)
        if n0 is not None:
            _checks.check_finite("truncation_value", n0[0], trunc)

    with torch.no_grad():
        pad = None if m is None else _steps.Padding(m, dtype, ends)
        adv, ret = _gae_scan(r, v, pad, carry, ends, gamma, lam, n0, boot, check)
    return GAEOutput(adv, ret)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    mask: Optional[torch.Tensor] = None,
    terminated: Optional[torch.Tensor] = None,
    truncated: Optional[torch.Tensor] = None,
    bootstrap_value: Optional[Number] = None,
    truncation_value: Optional[torch.Tensor] = None,
) -> GAEOutput:
    r"""Generalized Advantage Estimation (spec §6; Schulman et al., 2015).

    .. math::
        \delta_t = r_t + \gamma\,V^{next}_t - V_t,\qquad
        \hat A_t = \delta_t + \gamma\lambda\,c_t\,\hat A_{t'},\qquad
        \hat A_t = \sum_{l\ge0}(\gamma\lambda)^l\delta_{t+l}\ \text{(within an episode)},

    where :math:`t'` is the next valid step of the row and, for a valid step :math:`t`,
    the next value :math:`V^{next}_t` and the carry :math:`c_t` are:

    * ``terminated[b, t] = 1`` (true end): :math:`V^{next}_t=0`, :math:`c_t=0`;
    * ``truncated[b, t] = 1`` (cut by the collector mid-row):
      :math:`V^{next}_t=` ``truncation_value[b, t]``, :math:`c_t=0`;
    * last valid step of the row, neither flag: :math:`V^{next}_t=` ``bootstrap_value[b]``
      (default 0, i.e. the row ends its episode), :math:`c_t=0`;
    * otherwise :math:`V^{next}_t=V_{t'}`, :math:`c_t=1`.

    ``terminated`` wins when both flags are set. ``mask = 0`` steps are padding: they are
    skipped (the recursion connects consecutive valid steps, no discount across the gap),
    never terminal, and their outputs are 0. ``returns = advantages + values`` is the
    λ-return, the usual critic target. With ``lam = 1`` and a true terminal, ``advantages``
    equals the Monte Carlo reward-to-go minus the value; with ``lam = 0`` it is the TD
    residual :math:`\delta_t` (§24).

    The default ``bootstrap_value = 0`` treats the end of a row as the end of the episode;
    pass the critic's value of the state after the last step when the row was cut off and
    the episode could validly continue (§6, §20.4).

    Args:
      rewards: ``[B, T]`` per-step rewards.
      values: ``[B, T]`` critic values :math:`V(h_t)`.
      gamma: discount in ``[0, 1]``.
      lam: GAE :math:`\lambda` in ``[0, 1]``.
      mask: optional ``[B, T]`` 0/1 valid steps (default all valid).
      terminated: optional ``[B, T]`` 0/1 true episode ends (several episodes per row allowed).
      truncated: optional ``[B, T]`` 0/1 collector cuts in the middle of a row.
      bootstrap_value: optional ``[B]`` (or scalar) value after the last valid step; read
        only for rows whose last valid step is neither terminated nor truncated.
      truncation_value: ``[B, T]`` value of the cut-off next state; required when
        ``truncated`` has a 1 at a valid step, read only there.

    Returns:
      :class:`GAEOutput` ``(advantages, returns)``, each ``[B, T]``, 0 at masked steps.
      All inputs are evidence and detached; the outputs carry no gradient.
      Computed by a log-depth scan over time (no Python loop over steps).
    """
    return _gae_core(rewards, values, mask, gamma, lam, terminated, truncated, bootstrap_value, truncation_value)


def token_skip_observation_gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    terminated: Optional[torch.Tensor] = None,
    bootstrap_value: Optional[Number] = None,
    truncated: Optional[torch.Tensor] = None,
    truncation_value: Optional[torch.Tensor] = None,
) -> GAEOutput:
    r"""Skip-observation GAE on a token transcript (spec §20.4; SAO, Hou et al.).

    The transcript :math:`[a_0, o_0, a_1, o_1, \dots]` is ``[B, L]`` with ``mask = 1`` on the
    action tokens (sampled by the policy) and 0 on prompt, tool-observation and padding
    tokens. For an action token :math:`t` the next state is the next ``mask = 1`` token
    :math:`t'`, whose prefix contains the observation, so

    .. math::
        \delta_t = r_t + \gamma V_{t'} - V_t,\qquad
        \hat A_t = \delta_t + \gamma\lambda\hat A_{t'},

    with no :math:`\gamma`/:math:`\lambda` decay across observation tokens. At the last
    token :math:`a_{i,N}` of action :math:`i` this is exactly the §20.4 recursion
    :math:`\delta_i=r_i+\gamma V(a_{i+1,0})-V(a_{i,N})`; inside an action the usual
    token-level recursion applies. It skips *loss positions*, not information.

    Rewards are per token and must sit on action tokens (usually the last token of each
    action); values stored at ``mask = 0`` tokens are ignored. Terminal rules as in
    :func:`gae`: ``terminated = 1`` on a token zeroes the next value and the carried
    advantage; the last action token of a row bootstraps from ``bootstrap_value``
    (default 0); ``truncated``/``truncation_value`` mark collector cuts. This is
    :func:`gae` with the mask read as "observation or padding" (the two are handled the
    same way: skipped).

    Args:
      values: ``[B, L]`` token-wise critic values.
      rewards: ``[B, L]`` per-token rewards.
      mask: ``[B, L]`` 0/1 action mask.
      gamma, lam: in ``[0, 1]``.
      terminated, bootstrap_value, truncated, truncation_value: as in :func:`gae`.

    Returns:
      :class:`GAEOutput` with ``[B, L]`` advantages and returns, 0 at ``mask = 0`` tokens;
      detached. Vectorized over time (log-depth scan).
    """
    if mask is None:
        raise ValueError("mask: required (1 on action tokens, 0 on prompt/observation/padding)")
    return _gae_core(rewards, values, mask, gamma, lam, terminated, truncated, bootstrap_value, truncation_value)


def skip_observation_gae(
    action_end_values: torch.Tensor,
    next_action_values: torch.Tensor,
    rewards: torch.Tensor,
    terminals: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Skip-observation GAE with one entry per semantic model action (spec §20.4).

    .. math::
        \delta_i = r_i + \gamma(1-d_i)\,V(a_{i+1,0}) - V(a_{i,N}),\qquad
        \hat A_i = \delta_i + \gamma\lambda(1-d_i)\,\hat A_{i+1},

    with :math:`V(a_{i,N})` = ``action_end_values[i]`` (value at the last token of action
    :math:`i`), :math:`V(a_{i+1,0})` = ``next_action_values[i]`` (value at the first token of
    the next action, whose prefix contains observation :math:`o_i`; for the last action of a
    cut-off trajectory, the bootstrap value), :math:`d_i` = ``terminals[i]``. At a terminal
    the next value and the carried advantage are 0 (``next_action_values`` is not read there
    and may hold anything). After the last entry the carried advantage is 0.

    Args:
      action_end_values: ``[N]`` or ``[B, N]``.
      next_action_values: same shape.
      rewards: same shape, reward of each action.
      terminals: same shape, 0/1.
      gamma, lam: in ``[0, 1]``.
      mask: optional 0/1, same shape; 0 entries are padding, skipped (the carry passes to
        the next valid entry) and output as 0.

    Returns:
      Advantages with the shape of ``rewards``; detached. Vectorized (log-depth scan).
    """
    rewards = _steps.as_float("rewards", rewards)
    _checks.check_ndim("rewards", rewards, (1, 2))
    squeeze = rewards.ndim == 1
    shape = tuple(rewards.shape)
    if squeeze:
        rewards = rewards[None]

    def lift(name, x):
        x = _steps.as_float(name, x)
        _checks.check_shape(name, x, shape, against="rewards")
        return x[None] if squeeze else x

    gamma = _steps.check_rate("gamma", gamma)
    lam = _steps.check_rate("lam", lam)
    if mask is None:
        m = None
    else:
        m = _checks.check_mask("mask", mask, shape)
        m = (m[None] if squeeze else m).to(rewards.device)
    end_v = lift("action_end_values", action_end_values)
    next_v = lift("next_action_values", next_action_values)
    term_raw = _checks.as_tensor("terminals", terminals)
    _checks.check_shape("terminals", term_raw, shape, against="rewards")
    term = _checks.check_mask("terminals", term_raw)
    term = (term[None] if squeeze else term).to(rewards.device)
    if m is not None:
        term = term & m
    carry = ~term if m is None else m & ~term
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, end_v.dtype), next_v.dtype)
    for name, x, where in [("rewards", rewards, m), ("action_end_values", end_v, m),
                           ("next_action_values", next_v, carry)]:
        if not _steps.all_finite(x):
            _checks.check_finite(name, x, where)
    with torch.no_grad():
        ends = _right_padding_ends(m)
        pad = None if m is None else _steps.Padding(m, dtype, ends)
        # delta = r + gamma * carry * V_next - V_end, by selection where an input is not read
        adv = _steps.select(next_v.to(dtype), carry)
        adv.mul_(gamma).add_(rewards.to(dtype)).sub_(end_v.to(dtype))
        c = torch.empty_like(adv).copy_(carry).mul_(gamma * lam)
        if pad is not None:
            pad.zero_(adv)
            if ends is None:
                c.masked_fill_(pad.pad, 1.0)  # padding passes the carry through
        suffix_affine_scan_(adv, c)
        if pad is not None:
            pad.zero_(adv)
    return adv[0] if squeeze else adv


# ---------------------------------------------------------------------- the recipes' fields and registry entry
def _unit(name: str):
    def check(v) -> None:
        finite_positive(name, v, allow_zero=True)
        _checks.check_in_range(name, v, 0.0, 1.0)
    return check


_GAMMA_DOC = "discount and GAE λ (critic recipes)."
GAMMA = Param("gamma", 1.0, _GAMMA_DOC, float, _unit("gamma"))
LAM = Param("lam", 1.0, _GAMMA_DOC, float, _unit("lam"))
WHITEN_ADVANTAGES = Param(
    "whiten_advantages", False, "GAE advantages are whitened over every valid token of the batch, (A − μ) / "
    "sqrt(σ² + 1e-8) with Bessel's variance (verl's ``compute_gae_advantage_return``; ``trajgrad.advantages.whiten``; "
    "``whiten_eps_placement`` / ``whiten_empty`` choose the form); the value targets stay unwhitened.", bool, lambda v: flag("whiten_advantages", v))


def _gae(o, values, rewards, mask, terminated=None, bootstrap_value=None):
    out = token_skip_observation_gae(values, rewards, mask, gamma=o.gamma, lam=o.lam, terminated=terminated,
                                     bootstrap_value=bootstrap_value)
    if o.whiten_advantages:  # verl: whiten the advantages over the batch's valid tokens; targets unchanged
        out = out._replace(advantages=whiten(out.advantages, mask, eps_placement=o.whiten_eps_placement,
                                             empty=o.whiten_empty))
    return out


def _gae_text(o) -> str:
    s = (f"A_t = Σ_l (γλ)^l δ_{{t+l}},  δ_t = r_t + γ V(next action token) − V(t),  γ = {o.gamma:g}, "
         f"λ = {o.lam:g}\n"
         "    skip-observation: tool-observation and prompt tokens are bridged, not decayed through (§20.4);\n"
         "    true termination zeroes the bootstrap, truncation bootstraps from V (§6)")
    if o.whiten_advantages:
        scale = "sqrt(σ² + 1e-8)" if o.whiten_eps_placement == "variance" else "(σ + 1e-8)"
        s += (f"\n    whitened over the batch: A_t ← (A_t − μ) / {scale}, μ, σ² (Bessel) over every valid token\n"
              "    of the whole batch (verl); the value targets are computed before and stay unwhitened"
              + whiten_empty_text(o, "token"))
    return s


register_advantage_estimator(AdvantageEstimator(
    name="gae", level="token", call=_gae, fields=("gamma", "lam", "whiten_advantages"), needs_critic=True,
    text=_gae_text, params=(GAMMA, LAM, WHITEN_ADVANTAGES),  # the whitening's options: declared with REINFORCE++
    fields_when=lambda o: ("whiten_eps_placement", "whiten_empty") if o.whiten_advantages else (),
))
