r"""Returns, temporal-difference residuals and advantage estimators over time (spec §2, §3, §6, §20.4, §21).

All per-step tensors are ``[B, T]``: ``B`` rows, each a trajectory (or several episodes
concatenated, separated by ``terminated``), ``T`` steps. A step is a semantic action, or a
token when the functions run at token level (§4, §20.4).

===============================  ===========================================================
``discounted_return``            :math:`R=\sum_t\gamma^t r_t` (§2)
``reward_to_go``                 :math:`G_t=r_t+\gamma(1-d_t)G_{t+1}` (§3)
``gae``                          :math:`\hat A_t=\delta_t+\gamma\lambda(1-d_t)\hat A_{t+1}`,
                                 :math:`\delta_t=r_t+\gamma(1-d_t)V_{t+1}-V_t` (§6)
``n_step_advantage``             :math:`\hat A^{(n)}_t=\sum_{l<n}\gamma^l r_{t+l}+\gamma^nV_{t+n}-V_t` (§6)
``skip_observation_gae``         one entry per model action, values supplied explicitly (§20.4)
``token_skip_observation_gae``   the same on a token transcript, observation spans bridged
``shape_rewards``                :math:`r'_t=r_t+\gamma\Phi(s_{t+1})-\Phi(s_t)` (§21)
===============================  ===========================================================

Conventions shared by every function here:

* ``mask[b, t] == 0`` marks padding (or, at token level, prompt / tool-observation tokens).
  Padding is *skipped*: the recursion connects consecutive valid steps of a row, with no
  discount across the skipped span. Padding is never terminal. Outputs are exactly 0 at
  masked steps, and whatever is stored there (NaN and ±inf included) cannot change the
  outputs at valid steps: masked inputs are replaced by selection before any arithmetic.
* ``terminated[b, t] == 1``: the episode truly ends after step ``t``; the next value and
  the next advantage are 0 and the following valid step (if any) starts a new episode.
* Rewards, values and potentials are evidence: they are detached, and no output carries a
  gradient. (Train a critic with :func:`trajgrad.losses.value_loss` on the ``returns``.)
* Every backward recursion is evaluated without a Python loop over time: the affine
  recurrence :math:`A_t=d_t+c_tA_{t+1}` is solved by a work-efficient, log-depth
  parallel scan (pairs of steps are composed, the half-length problem is solved
  recursively, and the odd steps are filled in). It only multiplies coefficients in
  :math:`[0,1]` and adds bounded terms, so it neither overflows nor underflows at any
  length, unlike the closed form through :math:`c^t` and a reversed cumulative sum.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from . import _checks

Number = Union[float, int, torch.Tensor]

__all__ = [
    "GAEOutput",
    "discounted_return",
    "reward_to_go",
    "gae",
    "skip_observation_gae",
    "token_skip_observation_gae",
    "n_step_advantage",
    "shape_rewards",
]


class GAEOutput(NamedTuple):
    """Result of :func:`gae` and :func:`token_skip_observation_gae`.

    Attributes:
      advantages: ``[B, T]`` advantage estimates, 0 at masked steps (detached).
      returns: ``[B, T]`` value targets ``advantages + values`` (the λ-return), 0 at masked
        steps (detached).
    """

    advantages: torch.Tensor
    returns: torch.Tensor


# ---------------------------------------------------------------------------------------
# Scans over time (no Python loop over steps).
# ---------------------------------------------------------------------------------------


def _suffix_affine_scan(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    r"""Solve :math:`A_t=d_t+c_tA_{t+1}` for all ``t`` along the last axis, with :math:`A_T=0`.

    Returns a new tensor; ``d`` and ``c`` are not modified. See :func:`_suffix_affine_scan_`.
    """
    return _suffix_affine_scan_(d.clone(), c)


def _suffix_affine_scan_(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    r"""In-place version: overwrite ``d`` with the solution :math:`A` and return it.

    Work-efficient log-depth scan. Steps ``2i`` and ``2i+1`` compose into the affine map
    :math:`A_{2i}=(d_{2i}+c_{2i}d_{2i+1})+c_{2i}c_{2i+1}A_{2i+2}`; the half-length problem
    gives every even step, and each odd step follows from the next even one:
    :math:`A_{2i+1}=d_{2i+1}+c_{2i+1}A_{2i+2}`. For an odd length the last step is its own
    solution (:math:`A_{T-1}=d_{T-1}`) and closes the recursion of the even prefix. Total work
    is linear in ``T``, depth :math:`\lceil\log_2T\rceil`, and only half-length temporaries
    are allocated at each level.
    """
    length = d.shape[-1]
    if length <= 1:
        return d
    even = length - (length % 2)
    d_even, d_odd = d[..., 0:even:2], d[..., 1:even:2]
    c_even, c_odd = c[..., 0:even:2], c[..., 1:even:2]
    pair_d = torch.addcmul(d_even, c_even, d_odd)
    pair_c = c_even * c_odd
    tail = d[..., length - 1] if length % 2 else None
    if tail is not None:
        pair_d[..., -1].addcmul_(pair_c[..., -1], tail)
        pair_c[..., -1] = 0.0
    a_even = _suffix_affine_scan_(pair_d, pair_c)
    d_odd[..., :-1].addcmul_(c_odd[..., :-1], a_even[..., 1:])
    if tail is not None:
        d_odd[..., -1].addcmul_(c_odd[..., -1], tail)
    d_even.copy_(a_even)
    return d


def _shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """``y[..., t] = x[..., t + k]``, zero beyond the end."""
    length = x.shape[-1]
    if k >= length:
        return torch.zeros_like(x)
    return torch.cat([x[..., k:], x.new_zeros(x.shape[:-1] + (k,))], -1)


def _windowed_affine_sum(d: torch.Tensor, c: torch.Tensor, n: int) -> torch.Tensor:
    r""":math:`W_t=\sum_{l<n}\big(\prod_{j<l}c_{t+j}\big)d_{t+l}` (zero beyond the end).

    The first ``n`` steps of the recursion in :func:`_suffix_affine_scan`, composed by binary
    doubling of the window: :math:`O(T\log n)` work, no subtraction of two long sums.
    """
    length = d.shape[-1]
    n = min(n, length)
    acc_d = torch.zeros_like(d)
    acc_c = torch.ones_like(c)
    acc_len = 0
    pow_d, pow_c, pow_len = d, c, 1
    while n:
        if n & 1:
            acc_d = torch.addcmul(acc_d, acc_c, _shift_left(pow_d, acc_len))
            acc_c = acc_c * _shift_left(pow_c, acc_len)
            acc_len += pow_len
        n >>= 1
        if n:
            pow_d = torch.addcmul(pow_d, pow_c, _shift_left(pow_d, pow_len))
            pow_c = pow_c * _shift_left(pow_c, pow_len)
            pow_len *= 2
    return acc_d


def _coefficients(valid: torch.Tensor, carry: torch.Tensor, rate: float, dtype) -> torch.Tensor:
    """Scan coefficients: ``rate`` where a valid step carries, 0 where it does not, 1 at padding."""
    c = torch.full(valid.shape, rate, dtype=dtype, device=valid.device)
    c = c.masked_fill(~carry, 0.0)
    return c.masked_fill(~valid, 1.0)


def _next_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """For each step, the index of the next valid step of the row (``T`` if none)."""
    length = mask.shape[-1]
    idx = torch.arange(length, device=mask.device).expand_as(mask)
    idx = torch.where(mask, idx, torch.full_like(idx, length))
    suffix_min = torch.cummin(idx.flip(-1), -1).values.flip(-1)
    return torch.cat([suffix_min[..., 1:], torch.full_like(suffix_min[..., :1], length)], -1)


def _pack_left(mask: torch.Tensor):
    """Permutation that moves the valid steps of every row to the front (stable)."""
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    packed_mask = torch.gather(mask, -1, order)
    return order, packed_mask


def _unpack(packed: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(packed).scatter(-1, order, packed)


# ---------------------------------------------------------------------------------------
# Validation helpers.
# ---------------------------------------------------------------------------------------


def _as_float(name: str, x) -> torch.Tensor:
    x = _checks.as_tensor(name, x)
    if not x.is_floating_point():
        if x.dtype == torch.bool or not x.is_complex():
            x = x.to(torch.get_default_dtype())
        else:
            raise ValueError(f"{name}: expected a real tensor, got dtype {x.dtype}")
    return x.detach()


def _check_rate(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: must be a scalar, got shape {tuple(value.shape)}")
        value = value.item()
    try:
        value = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: must be a number in [0, 1], got {value!r}") from exc
    _checks.check_in_range(name, value, 0.0, 1.0)
    return value


def _steps(name: str, x, *, ndim=2) -> torch.Tensor:
    x = _as_float(name, x)
    _checks.check_ndim(name, x, ndim)
    return x


def _valid_mask(mask, shape, device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return _checks.check_mask("mask", mask, shape).to(device)


def _per_step(name: str, x, shape, mask: torch.Tensor, dtype) -> torch.Tensor:
    """Validate a ``[B, T]`` per-step input, detach it, and zero its masked steps."""
    x = _as_float(name, x)
    _checks.check_shape(name, x, shape, against="rewards")
    _checks.check_finite(name, x, mask)
    return _checks.fill_masked(x.to(dtype), mask)


def _per_row(name: str, x, rows: int, dtype, device, needed: Optional[torch.Tensor]) -> torch.Tensor:
    """A ``[B]`` (or scalar) per-row value; finite where ``needed`` (``[B]`` bool)."""
    if x is None:
        return torch.zeros(rows, dtype=dtype, device=device)
    x = _as_float(name, x)
    if x.ndim == 0:
        x = x.expand(rows)
    _checks.check_shape(name, x, (rows,))
    _checks.check_finite(name, x, needed)
    x = x.to(dtype=dtype, device=device)
    if needed is not None:
        x = _checks.fill_masked(x, needed)
    return x


def _prepare_rewards(rewards, mask):
    rewards = _steps("rewards", rewards)
    shape = tuple(rewards.shape)
    m = _valid_mask(mask, shape, rewards.device)
    _checks.check_finite("rewards", rewards, m)
    return _checks.fill_masked(rewards, m), m, shape


def _flag(name: str, x, shape, mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 per-step flag (terminated / truncated), False at masked steps."""
    if x is None:
        return torch.zeros(shape, dtype=torch.bool, device=mask.device)
    return _checks.check_mask(name, x, shape).to(mask.device) & mask


# ---------------------------------------------------------------------------------------
# Returns.
# ---------------------------------------------------------------------------------------


def discounted_return(rewards: torch.Tensor, mask: Optional[torch.Tensor] = None, *, gamma: float = 1.0) -> torch.Tensor:
    r"""Total discounted return of each row, :math:`R=\sum_{k}\gamma^{k}r_{t_k}` (spec §2).

    :math:`t_0<t_1<\dots` are the valid steps of the row; the exponent counts valid steps
    (padding is skipped, not discounted). Equal to ``reward_to_go(...)`` at the first valid
    step of a row with no terminations. With ``gamma = 1`` it is the plain sum.

    Args:
      rewards: ``[B, T]`` per-step rewards (detached; NaN/inf allowed at masked steps).
      mask: optional ``[B, T]`` 0/1 mask of valid steps (default: all valid).
      gamma: discount :math:`\gamma\in[0,1]`.

    Returns:
      ``[B]`` returns; 0 for a row with no valid step.
    """
    r, m, _ = _prepare_rewards(rewards, mask)
    gamma = _check_rate("gamma", gamma)
    k = (torch.cumsum(m.to(r.dtype), -1) - 1).clamp_min(0)
    weight = torch.pow(torch.as_tensor(gamma, dtype=r.dtype, device=r.device), k)
    return torch.where(m, weight * r, torch.zeros_like(r)).sum(-1)


def reward_to_go(
    rewards: torch.Tensor,
    *,
    gamma: float = 1.0,
    terminated: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Reward-to-go :math:`G_t=\sum_{l\ge0}\gamma^l r_{t+l}` within the episode (spec §3).

    .. math:: G_t = r_t + \gamma\,(1-d_t)\,G_{t'},

    where :math:`t'` is the next valid step of the row and :math:`d_t` = ``terminated``;
    :math:`G` is 0 after the last valid step. Several episodes can share a row: the sum
    resets after every step with ``terminated = 1``. Past rewards are dropped because their
    score-function term has zero expectation (§3); the :math:`\gamma^t` in front of the
    gradient term is a convention left to the caller.

    Args:
      rewards: ``[B, T]`` (detached).
      gamma: discount in ``[0, 1]``.
      terminated: optional ``[B, T]`` 0/1; ignored at masked steps.
      mask: optional ``[B, T]`` 0/1 valid steps; padding is skipped without discount.

    Returns:
      ``[B, T]`` reward-to-go, 0 at masked steps.
    """
    r, m, shape = _prepare_rewards(rewards, mask)
    gamma = _check_rate("gamma", gamma)
    term = _flag("terminated", terminated, shape, m)
    with torch.no_grad():
        c = _coefficients(m, ~term, gamma, r.dtype)
        g = _suffix_affine_scan(r, c)
    return torch.where(m, g, torch.zeros_like(g))


# ---------------------------------------------------------------------------------------
# GAE.
# ---------------------------------------------------------------------------------------


def _td_terms(r, v, m, gamma, term, trunc, trunc_value, bootstrap):
    """Next values (terminal/truncation/bootstrap rules) and the continuation flag."""
    nxt = _next_valid_index(m)
    length = m.shape[-1]
    has_next = nxt < length
    v_next = torch.gather(v, -1, nxt.clamp_max(length - 1))
    v_next = torch.where(has_next, v_next, bootstrap[:, None].expand_as(v))
    v_next = torch.where(trunc, trunc_value, v_next)
    v_next = torch.where(term, torch.zeros_like(v_next), v_next)
    delta = torch.where(m, r + gamma * v_next - v, torch.zeros_like(v))
    carry = has_next & ~term & ~trunc
    return delta, carry


def _finite_or_raise(name: str, x: torch.Tensor, where: Optional[torch.Tensor]) -> None:
    """``_checks.check_finite`` with a one-reduction fast path.

    A sum is finite only if every term is finite (NaN and ±inf propagate), so a finite sum
    proves the whole tensor finite; otherwise (a non-finite entry, or an overflowing sum)
    the exact masked check decides.
    """
    if not _checks.values_checked() or not x.is_floating_point() or x.numel() == 0:
        return
    if not bool(torch.isfinite(x.sum())):
        _checks.check_finite(name, x, where)


def _gae_core(rewards, values, mask, gamma, lam, terminated, truncated, bootstrap_value, truncation_value):
    r"""Shared body of :func:`gae` and :func:`token_skip_observation_gae`.

    Rather than locate the next valid step of every step, the scan runs on
    :math:`y_t=V_t+\lambda\hat A_t` and lets padding pass the carry through unchanged
    (coefficient 1, offset 0). Writing :math:`\hat A_t=r_t-V_t+\gamma N_t` with
    :math:`N_t=y_{t'}` when step :math:`t` carries on to the next valid step :math:`t'`, and
    :math:`N_t=N^0_t` (0, the truncation value or the bootstrap) when it does not, gives the
    affine recurrence :math:`y_t=(1-\lambda)V_t+\lambda r_t+\lambda\gamma N^0_t
    +\gamma\lambda\,\mathrm{carry}_t\,y_{t'}`, and :math:`y_{t'}` is the scan output one
    column to the right (padding passes it through).
    """
    rewards = _steps("rewards", rewards)
    shape = tuple(rewards.shape)
    bsz, length = shape
    device = rewards.device
    m = None if mask is None else _checks.check_mask("mask", mask, shape).to(device)
    gamma = _check_rate("gamma", gamma)
    lam = _check_rate("lam", lam)
    values = _as_float("values", values)
    _checks.check_shape("values", values, shape, against="rewards")
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    _finite_or_raise("rewards", rewards, m)
    _finite_or_raise("values", values, m)
    r, v = rewards.to(dtype), values.to(dtype)
    if m is not None:
        r, v = _checks.fill_masked(r, m), _checks.fill_masked(v, m)
        seen = torch.cumsum(m, -1, dtype=torch.int32)
        has_next = seen < seen[:, -1:]
        valid = m
    else:
        has_next = (torch.arange(length, device=device) < length - 1).expand(shape)
        valid = torch.ones(shape, dtype=torch.bool, device=device)
    stop = ~has_next  # steps after which the carry stops: row end, terminal, truncation
    term = trunc = None
    if terminated is not None:
        term = _flag("terminated", terminated, shape, valid)
        stop = stop | term
    if truncated is not None:
        trunc = _flag("truncated", truncated, shape, valid)
        if term is not None:
            trunc = trunc & ~term
        stop = stop | trunc
    carry = ~stop & valid

    n0 = None  # the next value where the carry stops (0 unless truncated / bootstrapped)
    if truncation_value is None:
        if trunc is not None and bool(trunc.any()):
            raise ValueError("truncation_value: required when truncated has a 1 at a valid step")
    else:
        if truncated is None:
            raise ValueError("truncation_value: given without truncated (it is read only at truncated steps)")
        tv = _as_float("truncation_value", truncation_value)
        _checks.check_shape("truncation_value", tv, shape, against="rewards")
        _checks.check_finite("truncation_value", tv, trunc)
        n0 = _checks.fill_masked(tv.to(dtype), trunc)
    if bootstrap_value is not None:
        # Read at the last valid step of a row unless that step ends the episode.
        open_end = valid & ~has_next
        if term is not None:
            open_end = open_end & ~term
        if trunc is not None:
            open_end = open_end & ~trunc
        boot = _per_row("bootstrap_value", bootstrap_value, bsz, dtype, device, open_end.any(-1))
        boot = torch.where(open_end, boot[:, None].expand(shape), torch.zeros((), dtype=dtype, device=device))
        n0 = boot if n0 is None else n0.add_(boot)

    with torch.no_grad():
        adv = r - v
        y = torch.add(v, adv, alpha=lam)  # (1 - lam) V + lam r
        if n0 is not None:
            y.add_(n0, alpha=lam * gamma)
        carry_f = carry.to(dtype)
        c = carry_f * (gamma * lam)
        if m is not None:
            c.add_((~m).to(dtype))  # coefficient 1 at padding (carry is 0 there)
        _suffix_affine_scan_(y, c)
        # adv = r - V + gamma * (carry ? y[t + 1] : n0). Every operand is finite here, so the
        # 0/1 factors below are products of finite numbers, never a masking of NaN/inf.
        if length > 1:
            adv[..., :-1].addcmul_(carry_f[..., :-1], y[..., 1:], value=gamma)
        if n0 is not None:
            adv.add_(n0, alpha=gamma)
        ret = adv + v
        if m is not None:
            valid_f = m.to(dtype)
            adv.mul_(valid_f)
            ret.mul_(valid_f)
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
    rewards = _as_float("rewards", rewards)
    _checks.check_ndim("rewards", rewards, (1, 2))
    squeeze = rewards.ndim == 1
    shape = tuple(rewards.shape)
    if squeeze:
        rewards = rewards[None]
    shape2 = tuple(rewards.shape)

    def lift(name, x):
        x = _as_float(name, x)
        _checks.check_shape(name, x, shape, against="rewards")
        return x[None] if squeeze else x

    gamma = _check_rate("gamma", gamma)
    lam = _check_rate("lam", lam)
    if mask is None:
        m = torch.ones(shape2, dtype=torch.bool, device=rewards.device)
    else:
        m = _checks.check_mask("mask", mask, shape)
        m = (m[None] if squeeze else m).to(rewards.device)
    end_v = lift("action_end_values", action_end_values)
    next_v = lift("next_action_values", next_action_values)
    term_raw = _checks.as_tensor("terminals", terminals)
    _checks.check_shape("terminals", term_raw, shape, against="rewards")
    term = _checks.check_mask("terminals", term_raw)
    term = (term[None] if squeeze else term).to(rewards.device) & m
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, end_v.dtype), next_v.dtype)
    _checks.check_finite("rewards", rewards, m)
    _checks.check_finite("action_end_values", end_v, m)
    _checks.check_finite("next_action_values", next_v, m & ~term)
    r = _checks.fill_masked(rewards.to(dtype), m)
    ve = _checks.fill_masked(end_v.to(dtype), m)
    vn = _checks.fill_masked(next_v.to(dtype), m & ~term)
    with torch.no_grad():
        delta = torch.where(m, r + gamma * vn - ve, torch.zeros_like(r))
        c = _coefficients(m, ~term, gamma * lam, dtype)
        adv = _suffix_affine_scan(delta, c)
        adv = torch.where(m, adv, torch.zeros_like(adv))
    return adv[0] if squeeze else adv


def n_step_advantage(
    rewards: torch.Tensor,
    values: torch.Tensor,
    n: int,
    *,
    gamma: float,
    bootstrap_value: Optional[Number] = None,
    terminated: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""The :math:`n`-step advantage estimator (spec §6).

    .. math::
        \hat A^{(n)}_t = \sum_{l=0}^{n-1}\gamma^l r_{t+l} + \gamma^n V(h_{t+n}) - V(h_t)
                       = \sum_{l=0}^{n-1}\gamma^l\delta_{t+l},

    with the TD residuals :math:`\delta` of :func:`gae`. Steps are counted over *valid*
    steps (padding skipped). The window stops early at the end of an episode: after a
    ``terminated`` step nothing more is added (the terminal value is 0), and after the last
    valid step of a row the estimate bootstraps from ``bootstrap_value`` (default 0), i.e.
    :math:`\sum_{l<m}\gamma^lr_{t+l}+\gamma^mB-V_t` when only :math:`m<n` steps remain.
    ``n = 1`` is the TD residual; ``n >= T`` is the Monte Carlo return (plus bootstrap)
    minus the value, i.e. GAE with :math:`\lambda=1`.

    Args:
      rewards, values: ``[B, T]``.
      n: window length, a positive integer.
      gamma: discount in ``[0, 1]``.
      bootstrap_value: optional ``[B]`` or scalar.
      terminated, mask: optional ``[B, T]`` 0/1.

    Returns:
      ``[B, T]`` advantages, 0 at masked steps; detached. :math:`O(T\log n)` vectorized.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
            n = int(n.item())
        else:
            raise ValueError(f"n: must be a positive integer, got {n!r}")
    if n < 1:
        raise ValueError(f"n: must be a positive integer, got {n}")
    rewards = _steps("rewards", rewards)
    shape = tuple(rewards.shape)
    m = _valid_mask(mask, shape, rewards.device)
    gamma = _check_rate("gamma", gamma)
    values = _as_float("values", values)
    _checks.check_shape("values", values, shape, against="rewards")
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    r = _per_step("rewards", rewards, shape, m, dtype)
    v = _per_step("values", values, shape, m, dtype)
    term = _flag("terminated", terminated, shape, m)
    last_open = None
    if bootstrap_value is not None:
        last = m & (_next_valid_index(m) >= shape[-1])
        last_open = (last & ~term).any(-1)
    boot = _per_row("bootstrap_value", bootstrap_value, shape[0], dtype, r.device, last_open)
    with torch.no_grad():
        no_trunc = torch.zeros_like(m)
        delta, carry = _td_terms(r, v, m, gamma, term, no_trunc, torch.zeros_like(r), boot)
        c = _coefficients(m, carry, gamma, dtype)
        order, packed_m = _pack_left(m)
        d_p = torch.gather(delta, -1, order)
        c_p = torch.where(packed_m, torch.gather(c, -1, order), torch.zeros_like(c))
        out = _unpack(_windowed_affine_sum(d_p, c_p, n), order)
        out = torch.where(m, out, torch.zeros_like(out))
    return out


# ---------------------------------------------------------------------------------------
# Potential-based shaping.
# ---------------------------------------------------------------------------------------


def shape_rewards(
    rewards: torch.Tensor,
    potentials: torch.Tensor,
    *,
    gamma: float,
    mask: Optional[torch.Tensor] = None,
    terminated: Optional[torch.Tensor] = None,
    zero_terminal_potential: bool = False,
) -> torch.Tensor:
    r"""Potential-based reward shaping (spec §21; Ng, Harada & Russell, 1999).

    .. math::
        r'_t = r_t + \gamma\,\Phi(s_{t+1}) - \Phi(s_t),\qquad
        G'_0 = G_0 - \Phi(s_0) + \gamma^T\Phi(s_T)\ \text{(telescoping)}.

    ``potentials`` is ``[B, T + 1]``: column ``t`` holds :math:`\Phi(s_t)`, the state in
    which step ``t`` acts. The successor state of a valid step is the state of the next
    valid step of the row (padding skipped, as everywhere in this module); for the last
    valid step it is column ``last + 1`` (column ``T`` for a row with no trailing padding,
    the first padding column otherwise), so a right-padded list of :math:`n+1` potentials
    lines up. Columns read by no valid step are ignored and may hold NaN/inf.

    Terminal potential: by default :math:`\Phi` of the terminal state is taken as given
    (the successor column). With ``zero_terminal_potential=True`` the successor potential
    of every ``terminated`` step is 0 (the standard absorbing-state convention; it keeps
    :math:`G'_0 = G_0 - \Phi(s_0)`, so the optimal policy is unchanged for any episode
    length). When a row holds several episodes, the column after a terminating step holds
    the next episode's first state, not the terminal one, so a termination before the last
    valid step requires ``zero_terminal_potential=True`` (otherwise ValueError).

    Args:
      rewards: ``[B, T]``.
      potentials: ``[B, T + 1]`` state potentials :math:`\Phi` (detached).
      gamma: discount in ``[0, 1]`` (must match the return the shaped rewards feed).
      mask: optional ``[B, T]`` 0/1 valid steps.
      terminated: optional ``[B, T]`` 0/1.
      zero_terminal_potential: zero :math:`\Phi` after terminated steps.

    Returns:
      ``[B, T]`` shaped rewards, 0 at masked steps; detached.
    """
    r, m, shape = _prepare_rewards(rewards, mask)
    gamma = _check_rate("gamma", gamma)
    potentials = _as_float("potentials", potentials)
    _checks.check_ndim("potentials", potentials, 2)
    bsz, length = shape
    _checks.check_shape("potentials", potentials, (bsz, length + 1))
    term = _flag("terminated", terminated, shape, m)
    nxt = _next_valid_index(m)
    is_last = m & (nxt >= length)
    if not zero_terminal_potential and bool((term & ~is_last).any()):
        raise ValueError(
            "terminated: a step terminates before the last valid step of its row, so the next "
            "column holds another episode's state; pass zero_terminal_potential=True"
        )
    cols = torch.arange(length, device=r.device).expand(bsz, length)
    succ = torch.where(is_last, cols + 1, nxt.clamp_max(length))
    zero_next = term if zero_terminal_potential else torch.zeros_like(term)
    # Columns read: the current state of every valid step, and the successor of every valid
    # step whose successor potential is not zeroed (count hits, so duplicates are harmless).
    hits = torch.zeros((bsz, length + 1), dtype=torch.int32, device=r.device)
    hits.scatter_add_(-1, succ, (m & ~zero_next).to(torch.int32))
    used = hits > 0
    used[:, :length] |= m
    _checks.check_finite("potentials", potentials, used)
    dtype = torch.promote_types(r.dtype, potentials.dtype)
    phi = _checks.fill_masked(potentials.to(dtype), used)
    with torch.no_grad():
        phi_now = phi[:, :length]
        phi_next = torch.gather(phi, -1, succ)
        phi_next = torch.where(zero_next, torch.zeros_like(phi_next), phi_next)
        out = r.to(dtype) + gamma * phi_next - phi_now
        out = torch.where(m, out, torch.zeros_like(out))
    return out
