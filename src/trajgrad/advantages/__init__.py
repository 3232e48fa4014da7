r"""Advantages and returns: everything that turns rewards (and values) into the detached
weights a policy loss multiplies with (spec §2–§6, §11, §12, §19–§21).

===========================  ===============================================================
:mod:`.returns`              discounted return, reward-to-go, n-step advantage, potential-based
                             shaping (§2, §3, §6, §21); re-exports the GAE family
:mod:`.td`                   GAE, token-level and per-action skip-observation GAE (§6, §20.4)
:mod:`.baselines`            group baselines: GRPO std, Dr. GRPO centred, batch std,
                             leave-one-out; whitening; turn → token broadcast (§5, §11, §12)
:mod:`.group_baselines`      pass@k, GPG, OPO, ReMax, the optimal token baseline
:mod:`.normalized`           REINFORCE++, MaxRL, GDPO: batch-normalized estimators
:mod:`.credit`               turn rewards at turn ends, bootstrap values, terminal masks
                             (§3, §6, §19, §20.4)
``_scan``, ``_steps``        private: the backward affine scan, per-step inputs
===========================  ===============================================================

Every public function is importable from this package. Tensors are ``[B, T]`` (per step or
token) or ``[N, G]`` (groups); masked steps are skipped and their contents never reach a
valid output; rewards and values are detached and no output carries a gradient.
"""
from .baselines import SCALES, GroupAdvantages, broadcast_to_tokens, group_advantages, leave_one_out, whiten
from .credit import (
    bootstrap_values,
    first_action_index,
    last_action_index,
    place_turn_rewards,
    terminal_token_mask,
    terminal_turn_mask,
    turn_end_positions,
)
from .group_baselines import (
    TokenAdvantages,
    gpg_advantages,
    opo_advantages,
    optimal_token_baseline,
    passk_advantages,
    remax_advantages,
)
from .normalized import gdpo_advantages, maxrl_advantages, reinforce_pp_advantages, reinforce_pp_token_advantages
from .returns import discounted_return, n_step_advantage, reward_to_go, shape_rewards
from .td import GAEOutput, gae, skip_observation_gae, token_skip_observation_gae

__all__ = [
    # returns (§2, §3, §6, §21)
    "discounted_return", "reward_to_go", "n_step_advantage", "shape_rewards",
    # GAE (§6, §20.4)
    "GAEOutput", "gae", "token_skip_observation_gae", "skip_observation_gae",
    # group baselines (§5, §11, §12)
    "GroupAdvantages", "SCALES", "group_advantages", "leave_one_out", "whiten", "broadcast_to_tokens",
    "TokenAdvantages", "passk_advantages", "gpg_advantages", "opo_advantages", "remax_advantages",
    "optimal_token_baseline",
    # batch-normalized estimators
    "reinforce_pp_advantages", "reinforce_pp_token_advantages", "maxrl_advantages", "gdpo_advantages",
    # credit assignment (§3, §6, §19, §20.4)
    "last_action_index", "first_action_index", "turn_end_positions", "place_turn_rewards",
    "terminal_token_mask", "terminal_turn_mask", "bootstrap_values",
]
