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
  recurrence :math:`A_t=d_t+c_tA_{t+1}` is solved by the work-efficient, log-depth
  parallel scan of :mod:`trajgrad.advantages._scan`. It only multiplies coefficients in
  :math:`[0,1]` and adds bounded terms, so it neither overflows nor underflows at any
  length, unlike the closed form through :math:`c^t` and a reversed cumulative sum.

The GAE family lives in :mod:`trajgrad.advantages.td` and is re-exported here, so every name in the
table imports from ``trajgrad.advantages.returns``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks
from . import _scan, _steps
from .td import GAEOutput, Number, gae, skip_observation_gae, token_skip_observation_gae

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
    r, m, _ = _steps.prepare_rewards(rewards, mask)
    gamma = _steps.check_rate("gamma", gamma)
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
    r, m, shape = _steps.prepare_rewards(rewards, mask)
    gamma = _steps.check_rate("gamma", gamma)
    term = _steps.flag("terminated", terminated, shape, m)
    with torch.no_grad():
        c = _steps.coefficients(m, ~term, gamma, r.dtype)
        g = _scan.suffix_affine_scan(r, c)
    return torch.where(m, g, torch.zeros_like(g))


# ---------------------------------------------------------------------------------------
# n-step advantage.
# ---------------------------------------------------------------------------------------


def _td_terms(r, v, m, gamma, term, trunc, trunc_value, bootstrap):
    """Next values (terminal/truncation/bootstrap rules) and the continuation flag."""
    nxt = _scan.next_valid_index(m)
    length = m.shape[-1]
    has_next = nxt < length
    v_next = torch.gather(v, -1, nxt.clamp_max(length - 1))
    v_next = torch.where(has_next, v_next, bootstrap[:, None].expand_as(v))
    v_next = torch.where(trunc, trunc_value, v_next)
    v_next = torch.where(term, torch.zeros_like(v_next), v_next)
    delta = torch.where(m, r + gamma * v_next - v, torch.zeros_like(v))
    carry = has_next & ~term & ~trunc
    return delta, carry


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
    rewards = _steps.steps("rewards", rewards)
    shape = tuple(rewards.shape)
    m = _steps.valid_mask(mask, shape, rewards.device)
    gamma = _steps.check_rate("gamma", gamma)
    values = _steps.as_float("values", values)
    _checks.check_shape("values", values, shape, against="rewards")
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    r = _steps.per_step("rewards", rewards, shape, m, dtype)
    v = _steps.per_step("values", values, shape, m, dtype)
    term = _steps.flag("terminated", terminated, shape, m)
    last_open = None
    if bootstrap_value is not None:
        last = m & (_scan.next_valid_index(m) >= shape[-1])
        last_open = (last & ~term).any(-1)
    boot = _steps.per_row("bootstrap_value", bootstrap_value, shape[0], dtype, r.device, last_open)
    with torch.no_grad():
        no_trunc = torch.zeros_like(m)
        delta, carry = _td_terms(r, v, m, gamma, term, no_trunc, torch.zeros_like(r), boot)
        c = _steps.coefficients(m, carry, gamma, dtype)
        order, packed_m = _scan.pack_left(m)
        d_p = torch.gather(delta, -1, order)
        c_p = torch.where(packed_m, torch.gather(c, -1, order), torch.zeros_like(c))
        out = _scan.unpack(_scan.windowed_affine_sum(d_p, c_p, n), order)
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
    r, m, shape = _steps.prepare_rewards(rewards, mask)
    gamma = _steps.check_rate("gamma", gamma)
    potentials = _steps.as_float("potentials", potentials)
    _checks.check_ndim("potentials", potentials, 2)
    bsz, length = shape
    _checks.check_shape("potentials", potentials, (bsz, length + 1))
    term = _steps.flag("terminated", terminated, shape, m)
    nxt = _scan.next_valid_index(m)
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
