r"""Credit assignment on token rows: where a turn's reward sits, where a row ends, what follows it.

A collated batch holds one trajectory (or compacted sub-trace) per row ``b``: per-token
tensors ``[B, L]`` aligned with the targets, ``mask[b, j] = 1`` on action tokens, and
``turn_ids[b, j]`` the turn (semantic action, §4) each action token belongs to. The
functions here are the small index computations every critic-based update needs, once:

* :func:`last_action_index` / :func:`first_action_index`: per row, the position of its
  last / first action token (-1 when the row has none);
* :func:`turn_end_positions`: ``[B, K]`` the last action token :math:`a_{k,N}` of each turn
  (§20.4 writes the TD residual of action :math:`k` at that token);
* :func:`place_turn_rewards`: the turn rewards :math:`r_k` written at those tokens, 0
  elsewhere: the token reward sequence of skip-observation GAE (§6, §20.4). It is the
  inverse of :func:`trajgrad.advantages.baselines.broadcast_to_tokens`: reading the placed tensor at
  :func:`turn_end_positions` gives back the turn rewards, and the placed tensor equals
  the broadcast one at the turn-end tokens and 0 elsewhere;
* :func:`terminal_token_mask` / :func:`terminal_turn_mask`: True at the last action token
  (resp. the last turn) of a row whose episode terminated; a terminal transition has no
  next value (§6, §20.4), a truncated one bootstraps;
* :func:`bootstrap_values`: :math:`V(s_T)` after each row's last action: 0 when it
  terminated, the next compacted sub-trace's first value when that sub-trace is in the
  batch (§19), else the row's own last value (a truncated row, §3: the reward-to-go of
  the unseen continuation is estimated, not assumed 0).

Pure tensor functions: nothing is learned and nothing carries a gradient unless the
caller's ``values`` do (:func:`bootstrap_values` selects them with ``torch.where``, so the
gradient reaches exactly the selected entries). Values at non-action positions may be
NaN/inf; they are never read into a result.
"""
from __future__ import annotations


import torch

from .. import _checks

__all__ = [
    "last_action_index",
    "first_action_index",
    "turn_end_positions",
    "place_turn_rewards",
    "terminal_token_mask",
    "terminal_turn_mask",
    "bootstrap_values",
]


def _mask2d(name: str, mask) -> torch.Tensor:
    m = _checks.as_tensor(name, mask)
    _checks.check_ndim(name, m, 2)
    return _checks.check_mask(name, m)


def _row_flags(name: str, x, B: int) -> torch.Tensor:
    t = _checks.as_tensor(name, x)
    _checks.check_shape(name, t, (B,))
    return _checks.check_mask(name, t)


def _int_tensor(name: str, x) -> torch.Tensor:
    t = _checks.as_tensor(name, x)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor, got dtype {t.dtype}")
    return t.to(torch.long)


def last_action_index(mask) -> torch.Tensor:
    r"""``[B]`` long: the position of each row's last action token, -1 for a row without one.

    .. math:: T_b=\max\{j : m_{b,j}=1\}

    Args:
      mask: ``[B, L]`` 0/1 (or bool) action mask.
    """
    m = _mask2d("mask", mask)
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    if m.shape[1] == 0:
        return torch.full((m.shape[0],), -1, dtype=torch.long, device=m.device)
    return torch.where(m, pos, torch.full_like(pos, -1)).max(1).values


def first_action_index(mask) -> torch.Tensor:
    r"""``[B]`` long: the position of each row's first action token, -1 for a row without one.

    Args:
      mask: ``[B, L]`` 0/1 (or bool) action mask.
    """
    m = _mask2d("mask", mask)
    B, L = m.shape
    if L == 0:
        return torch.full((B,), -1, dtype=torch.long, device=m.device)
    pos = torch.arange(L, device=m.device).expand_as(m)
    first = torch.where(m, pos, torch.full_like(pos, L)).min(1).values
    return torch.where(m.any(1), first, torch.full_like(first, -1))


def turn_end_positions(mask, turn_ids, num_turns: int) -> torch.Tensor:
    r"""``[B, K]`` long: the position of the last action token of turn ``k`` in row ``b``
    (the token :math:`a_{k,N}` at which §20.4 writes turn ``k``'s TD residual), -1 for a turn
    without action tokens (padding, or an empty action).

    Args:
      mask: ``[B, L]`` action mask.
      turn_ids: ``[B, L]`` integer turn of each token; read only where ``mask == 1``
        (anything, e.g. -1, elsewhere).
      num_turns: ``K``, the number of turn columns (``turn_mask.shape[1]``).
    """
    m = _mask2d("mask", mask)
    ids = _int_tensor("turn_ids", turn_ids)
    _checks.check_shape("turn_ids", ids, tuple(m.shape), against="mask")
    if isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < 0:
        raise ValueError(f"num_turns: expected a non-negative integer, got {num_turns!r}")
    bad = m & ((ids < 0) | (ids >= num_turns))
    if bool(bad.any()):
        raise ValueError(f"turn_ids: id {int(ids[bad][0])} at an action token is outside [0, {num_turns})")
    B, L = m.shape
    ks = torch.arange(num_turns, device=m.device)
    sel = m[:, None, :] & (ids[:, None, :] == ks[None, :, None])  # [B, K, L]
    pos = torch.arange(L, device=m.device).expand(B, num_turns, L)
    if L == 0:
        return torch.full((B, num_turns), -1, dtype=torch.long, device=m.device)
    return torch.where(sel, pos, torch.full_like(pos, -1)).max(2).values


def place_turn_rewards(turn_rewards, mask, turn_ids, turn_mask=None) -> torch.Tensor:
    r"""Each turn's reward on its last action token, 0 elsewhere (§6, §20.4).

    .. math:: r^{tok}_{b,j}=\sum_k \mathbb 1[j=\mathrm{end}_{b,k}]\;r_{b,k}

    with :math:`\mathrm{end}_{b,k}` from :func:`turn_end_positions`. This is the token
    reward sequence of (skip-observation) GAE: a turn's reward arrives after its last token,
    and the observation tokens between turns carry no loss position. Inverse of
    :func:`trajgrad.advantages.baselines.broadcast_to_tokens`: the result equals the broadcast turn
    values at the turn-end tokens and 0 at every other position.

    Args:
      turn_rewards: ``[B, K]`` float, one reward per turn (detached in the result); values
        of turns outside ``turn_mask`` or without action tokens may be NaN/inf and are not read.
      mask: ``[B, L]`` action mask.
      turn_ids: ``[B, L]`` integer turn of each action token.
      turn_mask: optional ``[B, K]`` valid turns (default: every turn with action tokens).

    Returns:
      ``[B, L]`` in ``turn_rewards``' dtype, detached, finite.
    """
    r = _checks.as_tensor("turn_rewards", turn_rewards)
    _checks.check_ndim("turn_rewards", r, 2)
    _checks.check_floating("turn_rewards", r)
    r = r.detach()
    m = _mask2d("mask", mask)
    if r.shape[0] != m.shape[0]:
        raise ValueError(f"turn_rewards: expected {m.shape[0]} rows (the rows of mask), got shape {tuple(r.shape)}")
    B, K = r.shape
    ends = turn_end_positions(m, turn_ids, K)
    valid = ends >= 0
    if turn_mask is not None:
        tm = _checks.check_mask("turn_mask", turn_mask, (B, K))
        valid = valid & tm
    _checks.check_finite("turn_rewards", r, valid)
    safe = torch.where(valid, r, torch.zeros_like(r))
    out = torch.zeros(m.shape, dtype=r.dtype, device=r.device)
    rows = torch.arange(B, device=r.device)[:, None].expand(B, K)
    out[rows[valid], ends[valid]] = safe[valid]
    return out


def terminal_token_mask(mask, terminated) -> torch.Tensor:
    r"""``[B, L]`` bool: True at the last action token of each row whose episode terminated.

    A terminal transition has no next state: GAE replaces the next value and the recursive
    advantage by 0 there (§6, §20.4). A truncated row (``terminated`` False) is all False and
    bootstraps (:func:`bootstrap_values`).

    Args:
      mask: ``[B, L]`` action mask.
      terminated: ``[B]`` bool, the episode ended in a terminal state after this row.
    """
    m = _mask2d("mask", mask)
    term = _row_flags("terminated", terminated, m.shape[0])
    last = last_action_index(m)
    out = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    rows = torch.arange(m.shape[0], device=m.device)
    has = last >= 0
    out[rows[has], last[has]] = term[has]
    return out


def terminal_turn_mask(turn_mask, terminated) -> torch.Tensor:
    r"""``[B, K]`` bool: True at the last valid turn of each row whose episode terminated
    (the per-turn form of :func:`terminal_token_mask`, used by potential shaping, §21, §6).

    Args:
      turn_mask: ``[B, K]`` valid turns.
      terminated: ``[B]`` bool.
    """
    tm = _mask2d("turn_mask", turn_mask)
    term = _row_flags("terminated", terminated, tm.shape[0])
    last = last_action_index(tm)
    ks = torch.arange(tm.shape[1], device=tm.device)[None]
    return term[:, None] & (ks == last[:, None])


def bootstrap_values(values, mask, terminated, next_rows) -> torch.Tensor:
    r"""``[B]`` :math:`V(s_T)`, the value after each row's last action token (§3, §6, §19, §20.4).

    .. math::

       V(s_{T_b})=\begin{cases}
         0 & \text{row } b \text{ terminated, or has no action token}\\
         V_{n,\ \mathrm{first}(n)} & n=\mathrm{next}_b\ge 0\ \text{(compacted; next sub-trace in the batch)}\\
         V_{b,\ \mathrm{last}(b)} & \text{otherwise (truncated, or the next sub-trace elsewhere)}
       \end{cases}

    A compacted sub-trace continues from the compacted information state (summary and
    observation) of its next sub-trace, whose first action token's value is the critic's
    estimate of it (§19); a truncated row bootstraps from the latest state the critic saw.

    Args:
      values: ``[B, L]`` critic values (float); may be NaN/inf off the action tokens. A
        gradient flows to the selected entries only.
      mask: ``[B, L]`` action mask.
      terminated: ``[B]`` bool.
      next_rows: ``[B]`` integer: the row of the next sub-trace of the same episode, -1 if
        none in the batch (``RolloutBatch.next_segment_rows()``); a next row without action
        tokens counts as absent.

    Returns:
      ``[B]`` in ``values``' dtype.
    """
    v = _checks.as_tensor("values", values)
    _checks.check_floating("values", v)
    m = _mask2d("mask", mask)
    _checks.check_shape("values", v, tuple(m.shape), against="mask")
    B, L = m.shape
    term = _row_flags("terminated", terminated, B)
    nxt = _int_tensor("next_rows", next_rows)
    _checks.check_shape("next_rows", nxt, (B,))
    if bool(((nxt < -1) | (nxt >= B)).any()):
        raise ValueError(f"next_rows: expected entries in [-1, {B}), got {nxt.tolist()}")
    rows = torch.arange(B, device=v.device)
    if bool((nxt == rows).any()):
        raise ValueError("next_rows: a row cannot continue in itself")
    zero = torch.zeros(B, dtype=v.dtype, device=v.device)
    if L == 0:
        return zero
    _checks.check_finite("values", v, m)
    last = last_action_index(m)
    first = first_action_index(m)
    has = last >= 0
    own = v[rows, last.clamp_min(0)]
    n = nxt.clamp_min(0)
    follow = (nxt >= 0) & has[n]
    boot = torch.where(follow, v[n, first[n].clamp_min(0)], own)
    return torch.where(term | ~has, zero, boot)
