r"""Recipes as data: an :class:`Objective` states every choice that defines an update.

A recipe is a frozen record of the decisions that words like "normalize", "clip" or
"distill" hide: which advantage estimator (§5, §6, §11, §12, §20.4), which importance ratio
(§7, §17), how it is clipped or gated (§8, §18, §20.2), how per-token terms are aggregated
(§13), where KL to the reference enters (§9), the entropy bonus, and what is detached.

``Objective.loss`` names a policy term and ``Objective.advantage`` an advantage estimator,
both entries of the registries in :mod:`trajgrad.registry`; each built-in entry is declared in
the module of its function (``trajgrad.losses.*``, ``trajgrad.advantages.baselines``,
``trajgrad.advantages.normalized``, ``trajgrad.advantages.group_baselines``, ``trajgrad.advantages.td``), with the :class:`~trajgrad.registry.Param`
declarations of the fields it owns. ``Objective``'s fields are composed from those
declarations and the recipe-wide ones below. :meth:`Objective.policy_loss`
computes the loss *only* through those entries, and :func:`explain` prints the estimator from
the same entries and fields, so what is printed is what is optimized: a field that the
chosen entries do not read cannot be changed (``replace`` refuses it), and every field that
is read is printed.

``RECIPES`` (:mod:`trajgrad.recipes`) holds the named recipes with the defaults of their
papers; :func:`explain_diff` prints two recipes side by side, term by term.
"""
from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Dict, Optional, Tuple

import torch

from .. import _checks, advantages, losses  # noqa: F401  (their entries)
from .._aggregation import aggregate_valid, validate_mode
from ..aggregate import MODES
from ..entropy_control import next_entropy_coef
from ..logprobs.correction import OFF, RolloutCorrection
from ..losses import kl_estimate, resolve_eps_high, value_loss
from ..registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_TERMS,
    AdvantageEstimator,
    Param,
    PolicyInputs,
    PolicyTerm,
    declare,
    finite_positive,
    flag,
    register_advantage_estimator,
    seal_params,
)
from ..types import LossResult
from ._validate import validate

KL_PLACEMENTS = ("none", "reward", "loss")
KL_KINDS = ("k1", "k2", "k3", "k1+", "k3+", "low_var_kl", "low_var_kl+")
# kl_kind -> (kind, clamp) of trajgrad.losses.kl_estimate: verl's "low_var_kl" (its "k3") is k3
# clamped to [-10, 10]; the "+" kinds take the k2 gradient (verl's straight-through "k3+")
_KL_ESTIMATE_ARGS = {
    "k1": ("k1", None), "k2": ("k2", None), "k3": ("k3", None), "k1+": ("k1+", None), "k3+": ("k3+", None),
    "low_var_kl": ("k3", 10.0), "low_var_kl+": ("k3+", 10.0),
}
# fields every recipe reads (the rest are read only by the entries or modes that declare them)
_ALWAYS = ("name", "loss", "advantage", "aggregation", "kl_placement", "entropy_coef", "group_size", "paper")
# fields that set the training schedule, not the value of one loss evaluation
SCHEDULE_FIELDS = ("group_size", "dynamic_sampling", "critic_updates", "entropy_target", "entropy_coef_lr",
                   "entropy_coef_max")
# the adaptive entropy coefficient's fields, read once a target is set
_ENTROPY_TARGET_FIELDS = ("entropy_coef_lr", "entropy_coef_max")
_REQUIRED = dataclasses.MISSING


def _optional_positive(name: str):
    def check(v) -> None:
        if v is not None:
            finite_positive(name, v)
    return check


def _count(name: str):
    def check(v) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    return check


def _nonneg(name: str):
    return lambda v: finite_positive(name, v, allow_zero=True)


def _optional_nonneg(name: str):
    def check(v) -> None:
        if v is not None:
            finite_positive(name, v, allow_zero=True)
    return check


_KL_DOC = ("KL to the reference policy (§9): ``\"none\"`` (no KL term, ``kl_coef`` 0), in the ``\"reward\"`` (per "
           "token, ``r_t - kl_coef * k``) or as a ``\"loss\"`` term (``+ kl_coef * aggregate(k)``); ``kl_kind`` the "
           "estimator k of :data:`KL_KINDS`. Setting ``kl_placement`` to ``\"none\"`` sets ``kl_coef`` to 0.")
_ENTROPY_TARGET_DOC = (
    "adaptive entropy control (:mod:`trajgrad.entropy_control`; Skywork-OR1): after every step ``c ← clip(c + "
    "entropy_coef_lr · (entropy_target − H̄), 0, entropy_coef_max)``, ``H̄`` the step's token-mean entropy (nats). "
    "``None``: constant. Schedule fields: a loss evaluation reads ``entropy_coef`` only; the trainer carries ``c`` "
    "(saved in checkpoints).")

# the recipe-wide fields (every entry's own fields are declared in its module)
RECIPE_PARAMS: Tuple[Param, ...] = declare(
    Param("name", _REQUIRED, "recipe name.", str),
    Param("loss", _REQUIRED, "policy term, a key of :data:`trajgrad.registry.POLICY_TERMS` (``reinforce``, ``ppo``, "
          "``gspo``, ``gspo_token``, ``sapo``, ``sao``, ``opd``, ``dpo``, ...).", str,
          lambda v: _checks.check_choice("loss", v, tuple(POLICY_TERMS))),
    Param("advantage", _REQUIRED, "advantage estimator, a key of :data:`trajgrad.registry.ADVANTAGE_ESTIMATORS`: "
          "``return`` (raw return, §2), ``group_std`` (GRPO, §11), ``group_center`` (Dr. GRPO, §12), ``batch_std`` "
          "(centred per group, scaled by the batch std), ``leave_one_out`` (RLOO, §5), ``gae`` (critic + token-level "
          "skip-observation GAE, §6/§20.4), ``reinforce_pp`` / ``reinforce_pp_baseline`` (REINFORCE++: batch "
          "normalization, without or after the group mean), ``maxrl`` ((R − mean)/mean), ``gdpo`` (per-component "
          "group normalization, summed, batch normalized; ``trajgrad.advantages``), ``none`` (the loss needs no "
          "advantage: OPD, DPO).", str, lambda v: _checks.check_choice("advantage", v, tuple(ADVANTAGE_ESTIMATORS))),
    Param("aggregation", _REQUIRED, "one of :data:`trajgrad.aggregate.MODES` (§13).", str,
          lambda v: _checks.check_choice("aggregation", v, MODES)),
    Param("constant", None, "Dr. GRPO's constant normalizer (``seq_sum_constant``); ``None`` = the padded generation "
          "length.", Optional[float], _optional_positive("constant")),
    Param("kl_coef", 0.0, _KL_DOC, float, _nonneg("kl_coef")),
    Param("kl_placement", "none", _KL_DOC, str, lambda v: _checks.check_choice("kl_placement", v, KL_PLACEMENTS)),
    Param("kl_kind", "k1", _KL_DOC, str, lambda v: _checks.check_choice("kl_kind", v, KL_KINDS)),
    Param("group_size", 1, "rollouts per prompt (1 for single-rollout methods).", int, _count("group_size")),
    Param("dynamic_sampling", False, "resample groups with zero reward variance (DAPO, §11); every discarded group "
          "and its generation cost are logged.", bool),
    Param("critic", False, "the recipe trains a value function (exactly when its estimator needs one).", bool),
    Param("critic_updates", 1, "K critic updates per actor update (SAO §20.3).", int, _count("critic_updates")),
    Param("value_clip", None, "PPO value-clipping range (``None`` = off); the critic's loss is :meth:`value_loss`, "
          "in its own backward pass and optimizer.", Optional[float], _optional_positive("value_clip")),
    Param("entropy_coef", 0.0, "weight of the entropy bonus ``− entropy_coef · aggregate(H(π_θ))``, where ``H`` is "
          "the exact entropy of the full sampling distribution (0 = off). With ``entropy_target`` set it is the "
          "coefficient *now* (the start value in a recipe).", float, _nonneg("entropy_coef")),
    Param("entropy_target", None, _ENTROPY_TARGET_DOC, Optional[float], _optional_nonneg("entropy_target")),
    Param("entropy_coef_lr", 0.01, _ENTROPY_TARGET_DOC, float, lambda v: finite_positive("entropy_coef_lr", v)),
    Param("entropy_coef_max", 0.05, _ENTROPY_TARGET_DOC, float, lambda v: finite_positive("entropy_coef_max", v)),
    Param("paper", "", "the reference the defaults come from.", str),
    Param("kl_bias_correction", False, "the KL loss term is weighted by the attached ratio ρ = π_θ / sg[π_old] "
          "(TRL's ``use_bias_correction_kl``, on by default in TRL 1.16): the unbiased reverse-KL gradient for tokens "
          "sampled from π_old (on-policy, without ``old_logp``, ρ = π_θ/sg[π_θ]). ``kl_kind`` also takes verl's "
          "``low_var_kl`` (k3 clamped to [−10, 10], what verl calls ``k3``) and the straight-through ``k1+``, "
          "``k3+``, ``low_var_kl+`` (value of k1 / k3 / clamped k3, gradient of k2; verl's ``k3+`` is "
          "``low_var_kl+``).", bool, lambda v: flag("kl_bias_correction", v)),
    Param("rollout_correction", OFF, "a :class:`trajgrad.logprobs.correction.RolloutCorrection` (or a dict of its fields: "
          "kind, level, cap, cap_low, bounds, reject, reject_threshold, reject_level, seq_mask_delta, mode, "
          "advantage_level, mismatch_policy); ``None`` (stored "
          "as the no-op setting) is off. Applied by :meth:`policy_loss` to every token recipe, with "
          "``behaviour_logp``.", RolloutCorrection),
)

register_advantage_estimator(AdvantageEstimator(
    name="none", level="none", call=None, fields=(), text=lambda o: "none (the loss takes no advantage)",
))

# the order of Objective's fields (its constructor, ``to_dict``, ``explain_diff``); a field declared later
# (a new entry's) follows in declaration order
_ORDER = ("name", "loss", "advantage", "aggregation", "constant", "eps_low", "eps_high", "dual_clip", "tau_pos",
          "tau_neg", "ratio_gradient", "beta", "kl_coef", "kl_placement", "kl_kind", "gamma", "lam", "std_eps",
          "group_size", "dynamic_sampling", "critic", "critic_updates", "value_clip", "entropy_coef", "entropy_target",
          "entropy_coef_lr", "entropy_coef_max", "paper", "jsd_beta", "jsd_normalized", "std_unbiased",
          "whiten_advantages", "kl_bias_correction", "dpo_loss_type", "label_smoothing", "simpo_gamma", "sapo_level",
          "weight_eps_low", "log_clip_low", "log_clip_high", "delta_low", "delta_high", "dppo_ratio_cap", "cov_ratio",
          "cov_low", "cov_kl_coef", "rollout_correction", "mask_eps_low", "mask_eps_high", "cov_selected", "cov_band",
          "cov_exclude_clipped", "kl_cov_positive_only", "kl_cov_base", "gmpo_clip_level", "whiten_eps_placement",
          "whiten_empty", "maxrl_eps", "maxrl_eps_mode", "maxrl_centred", "teacher_direction", "teacher_zero_sum",
          "lagrangian_lambda", "lagrangian_budget")  # the order of the fields whatever imports first


def _fields() -> Tuple[Param, ...]:
    params = {p.name: p for p in seal_params()}
    return tuple(params[n] for n in _ORDER) + tuple(p for n, p in params.items() if n not in _ORDER)


def _attributes_doc(params: Tuple[Param, ...]) -> str:
    """The ``Attributes:`` section: one entry per declaration, fields sharing one description together."""
    out, i = [], 0
    while i < len(params):
        j = i + 1
        while j < len(params) and params[j].doc is params[i].doc:
            j += 1
        head = ", ".join(p.name for p in params[i:j]) + ": " + params[i].doc
        out += textwrap.wrap(head, 100, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False,
                             break_long_words=False)
        i = j
    return "\n".join(out)


class _ObjectiveMethods:
    """The methods of :class:`Objective` (its fields are composed from the declarations)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rollout_correction", RolloutCorrection.coerce(self.rollout_correction))
        for p in _PARAMS:
            if p.check is not None:
                p.check(getattr(self, p.name))
        validate(self)

    # ------------------------------------------------------------------ the entries
    @property
    def term(self) -> PolicyTerm:
        """The policy-term registry entry (``POLICY_TERMS[self.loss]``)."""
        return POLICY_TERMS[self.loss]

    @property
    def estimator(self) -> AdvantageEstimator:
        """The advantage-estimator registry entry (``ADVANTAGE_ESTIMATORS[self.advantage]``)."""
        return ADVANTAGE_ESTIMATORS[self.advantage]

    @property
    def kind(self) -> str:
        """``"token"``, ``"pairwise"`` (DPO-style preference pairs) or ``"distill"`` (OPD)."""
        return self.term.kind

    @property
    def ratio_source(self) -> str:
        """``"none"``, ``"old"`` (recomputed before the update) or ``"behaviour"`` (the sampler's)."""
        return self.term.ratio

    @property
    def uses_old_logp(self) -> bool:
        return self.term.ratio != "none"

    @property
    def uses_reference(self) -> bool:
        return self.kl_placement != "none" or self.kind == "pairwise"

    @property
    def advantage_level(self) -> str:
        """``"sequence"``, ``"token"`` or ``"none"``."""
        return self.estimator.level

    @property
    def zero_without_advantage(self) -> bool:
        r"""The whole loss of a row with zero advantages is zero with a zero gradient: the
        term declares it (``PolicyTerm.zero_without_advantage``), no KL term is in the loss
        (``kl_placement != "loss"``) and no entropy bonus can be (``entropy_coef == 0``,
        ``entropy_target`` unset). The rollout correction multiplies the term, so it keeps
        the zero."""
        return (self.term.zero_without_advantage and self.kl_placement != "loss" and self.entropy_coef == 0
                and self.entropy_target is None)

    def rows_without_gradient(self, advantages: torch.Tensor, mask: torch.Tensor) -> Optional[torch.Tensor]:
        r"""``[B]`` bool: the rows whose loss and gradient are exactly zero, ``None`` when the
        recipe has a term that does not vanish with the advantage (:attr:`zero_without_advantage`).

        Row :math:`i` qualifies when :math:`A_{it} = 0` at all its action tokens (per-response
        advantages: :math:`A_i = 0`), or it has none; a GRPO group with one reward for every
        response is such a set of rows. The value at masked positions is not read (NaN there
        is ignored); a NaN advantage at an action token keeps the row. With the step's
        denominator computed over every row, the loss of the other rows alone has the full
        batch's gradient (§13)."""
        if not self.zero_without_advantage:
            return None
        valid = _checks.check_mask("mask", mask)
        if valid.ndim != 2:
            raise ValueError(f"mask: expected [B, L], got shape {tuple(valid.shape)}")
        if advantages.ndim == 1:
            _checks.check_shape("advantages", advantages, (valid.shape[0],), against="the mask's rows")
            moving = (advantages != 0) & valid.any(-1)
        else:
            _checks.check_shape("advantages", advantages, tuple(valid.shape), against="mask")
            moving = (valid & (advantages != 0)).any(-1)
        return ~moving

    @property
    def eps_high_(self) -> float:
        """The upper clip: ``eps_high``, or ``eps_low`` where it is ``None`` (:func:`trajgrad.losses.resolve_eps_high`)."""
        return resolve_eps_high(self.eps_low, self.eps_high)

    def read_fields(self) -> Tuple[str, ...]:
        """Every field this recipe's loss, advantages or schedule read (the rest have no effect)."""
        f = list(_ALWAYS) + list(self.term.fields) + list(self.estimator.fields)
        for entry in (self.term, self.estimator):
            if entry.fields_when is not None:
                f += list(entry.fields_when(self))
        if self.kl_placement != "none":
            f += ["kl_coef", "kl_kind"]
        if self.kl_placement == "loss":
            f.append("kl_bias_correction")
        if self.kind == "pairwise":
            f += ["dpo_loss_type", "label_smoothing"] + (["simpo_gamma"] if self.dpo_loss_type == "simpo" else [])
        if self.aggregation == "seq_sum_constant":
            f.append("constant")
        if self.critic:
            f += ["critic", "critic_updates", "value_clip"]
        if self.group_size > 1 or self.estimator.min_group > 1:
            f.append("dynamic_sampling")
        if self.term.kind == "token":
            f += ["rollout_correction", "entropy_target"]
            if self.entropy_target is not None:
                f += list(_ENTROPY_TARGET_FIELDS)
        return tuple(dict.fromkeys(f))

    def replace(self, **changes: Any) -> "Objective":
        """A copy with some fields changed (validated again).

        A field that the resulting recipe does not read (for example ``tau_pos`` on a PPO
        recipe) can only be set to its default: anything else would be printed but never
        optimized, so it raises ``ValueError`` naming the field. ``kl_placement="none"``
        removes the KL term: ``kl_coef`` becomes 0 unless given.
        """
        names = {f.name: f for f in dataclasses.fields(self)}
        unknown = set(changes) - set(names)
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not a field of Objective")
        if changes.get("kl_placement") == "none" and "kl_coef" not in changes:
            changes = {**changes, "kl_coef": 0.0}
        new = dataclasses.replace(self, **changes)
        read = set(new.read_fields())
        for k, v in changes.items():
            if k not in read and v != names[k].default:
                raise ValueError(f"{k}: has no effect with loss {new.loss!r}, advantage {new.advantage!r} and "
                                 f"kl_placement {new.kl_placement!r} (the fields it reads: {', '.join(sorted(read))})")
        return new

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ adaptive entropy control
    @property
    def adaptive_entropy(self) -> bool:
        """The entropy coefficient adapts to ``entropy_target`` from step to step."""
        return self.entropy_target is not None

    def next_entropy_coef(self, entropy: float) -> float:
        r"""The coefficient for the next step from the entropy measured in this one (nats per
        token): ``clip(entropy_coef + entropy_coef_lr · (entropy_target − entropy), 0,
        entropy_coef_max)`` (:func:`trajgrad.entropy_control.next_entropy_coef`)."""
        if not self.adaptive_entropy:
            raise ValueError("entropy_target: is None; the entropy coefficient does not adapt")
        return next_entropy_coef(self.entropy_coef, entropy, target=self.entropy_target, lr=self.entropy_coef_lr,
                                 coef_max=self.entropy_coef_max)

    # ------------------------------------------------------------------ advantages
    def sequence_advantages(self, rewards: torch.Tensor, group_ids: Optional[torch.Tensor] = None):
        """Per-response advantages from per-response rewards (sequence-level estimators).

        Args:
          rewards: ``[N, G]`` (``N`` prompts × ``G`` rollouts) or ``[M]`` with ``group_ids``.
        Returns:
          ``trajgrad.advantages.GroupAdvantages`` (advantages in the shape of ``rewards``,
          and the per-group zero-variance flags that dynamic sampling and the logs use).
        """
        if self.estimator.level != "sequence":
            raise ValueError(f"advantage: {self.advantage!r} is not a per-response estimator (use token_advantages)")
        return self.estimator.call(self, rewards, group_ids)

    def token_advantages(self, values, rewards, mask, *, terminated=None, bootstrap_value=None):
        """Token-level advantages and value targets for critic recipes (§6, §20.4)."""
        if self.estimator.level != "token":
            raise ValueError(f"advantage: token_advantages needs a token-level estimator, recipe uses {self.advantage!r}")
        return self.estimator.call(self, values, rewards, mask, terminated, bootstrap_value)

    def kl_per_token(self, logp, ref_logp, mask, *, old_logp=None) -> torch.Tensor:
        """The recipe's per-token KL estimate ``k(logp, ref_logp)`` (``kl_kind``; §9), ``[B, L]``.

        ``old_logp`` is used only with ``kl_bias_correction`` (the ratio weight to the sampling policy).
        """
        kind, clamp = _KL_ESTIMATE_ARGS[self.kl_kind]
        return kl_estimate(logp, ref_logp, mask, kind=kind, clamp=clamp, old_logp=old_logp)

    def kl_in_reward(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-token KL penalty ``kl_coef * k(logp, ref_logp)`` to subtract from rewards (§9).

        Detached: a reward is evidence. Zero when the recipe puts no KL in the reward.
        """
        if self.kl_placement != "reward":
            return torch.zeros_like(logp).detach()
        return (self.kl_coef * self.kl_per_token(logp.detach(), ref_logp, mask)).detach()

    # ------------------------------------------------------------------ the loss
    def loss_fn(self):
        """The core loss function this recipe calls (for introspection and ``verify``)."""
        return self.term.fn

    def policy_loss(
        self,
        logp: torch.Tensor,
        advantages: Optional[torch.Tensor],
        mask: torch.Tensor,
        *,
        old_logp: Optional[torch.Tensor] = None,
        behaviour_logp: Optional[torch.Tensor] = None,
        ref_logp: Optional[torch.Tensor] = None,
        entropy: Optional[torch.Tensor] = None,
        denominator: Optional[Any] = None,
        constant: Optional[float] = None,
        cost_advantages: Optional[torch.Tensor] = None,
    ) -> LossResult:
        r"""The recipe's loss on one (micro-)batch of token log-probs.

        .. math::
            \mathcal L = \operatorname{term}(\log\pi_\theta, \mathrm{sg}[\log\pi_{ratio}], A)
              + c_{KL}\,\operatorname{agg}(k(\log\pi_\theta, \log\pi_{ref}))
              - c_H\,\operatorname{agg}(H_\theta)

        The term's ratio is taken against ``old_logp`` (terms with ``ratio="old"``) or
        ``behaviour_logp`` (``ratio="behaviour"``, falling back to ``old_logp`` when only that
        is given). The KL term enters only when ``kl_placement == "loss"``; the entropy bonus
        only when ``entropy_coef > 0``, and then ``entropy`` (the exact per-token entropy of
        the full sampling distribution, ``[B, L]``, *with* its gradient) is required. Every
        term uses the recipe's aggregation and the same ``denominator``, so micro-batches and
        ranks sum to the full-batch loss (§13). DPO: :meth:`dpo_loss`; OPD: :meth:`distill_loss`.
        With ``entropy_target`` set, :math:`c_H` is ``entropy_coef``, the coefficient of the
        current step (the trainer evaluates ``replace(entropy_coef=c_t)``).

        **Rollout correction** (``rollout_correction`` set; needs ``behaviour_logp``): in
        ``"decoupled"`` mode the term's ratio stays against ``old_logp`` and each token's term
        is multiplied by the detached weight computed from :math:`\pi_{old}/\mu`; in
        ``"bypass"`` mode the term's ratio is taken against ``behaviour_logp`` (``old_logp`` is
        not needed) and only the masks apply, computed from :math:`\mathrm{sg}[\pi_\theta]/\mu`
        (:mod:`trajgrad.logprobs.correction`). Dropped tokens leave the numerator and stay in the
        denominator. The correction's metrics (``correction/*``) join the term's. The KL and
        entropy terms are not re-weighted. ``cost_advantages``: only for a term that reads them
        (``PolicyTerm.inputs``, the Lagrangian term of §22), required there.
        """
        term = self.term
        if term.kind != "token":
            method = "dpo_loss" if term.kind == "pairwise" else "distill_loss"
            raise ValueError(f"loss: recipe {self.name!r} is {term.kind}; call Objective.{method}")
        if advantages is None:
            raise ValueError(f"advantages: required by loss {self.loss!r}")
        if (cost_advantages is None) == ("cost_advantages" in term.inputs):
            raise ValueError(f"cost_advantages: required by loss {self.loss!r}" if cost_advantages is None else
                             f"cost_advantages: loss {self.loss!r} reads no cost advantages")
        rc = self.rollout_correction
        bypass = bool(rc) and rc.mode == "bypass"
        if rc and behaviour_logp is None:
            raise ValueError("behaviour_logp: required by rollout_correction (the log-probs recorded at sampling)")
        if rc or self.kl_placement == "loss" or self.entropy_coef > 0:
            # read by more than the term: the mask is checked once, here, and handed on as bool (not re-read)
            mask = _checks.check_mask("mask", mask, tuple(_checks.as_tensor("logp", logp).shape))
            validate_mode(self.aggregation, self.constant if constant is None else constant)
        ratio_logp = None
        if term.ratio == "old" and not bypass:
            if old_logp is None:
                raise ValueError(f"old_logp: required by loss {self.loss!r}")
            ratio_logp = old_logp
        elif term.ratio != "none":
            ratio_logp = behaviour_logp if behaviour_logp is not None else old_logp
            if ratio_logp is None:
                raise ValueError(f"behaviour_logp: required by loss {self.loss!r} (its ratio is to the sampler's log-probs)")
        c = self.constant if constant is None else constant
        agg = dict(aggregation=self.aggregation, constant=c, denominator=denominator)
        corr = None
        if rc:
            if bypass:
                target = logp.detach()
            else:
                if old_logp is None:
                    raise ValueError("old_logp: required by rollout_correction in 'decoupled' mode (the proximal log-probs)")
                target = old_logp
            corr = rc(behaviour_logp, target, mask, advantages=advantages if rc.seq_mask_delta is not None else None,
                      current_logp=logp.detach())
            agg["weights"] = corr.weight
        res = term.call(self, PolicyInputs(logp, advantages, mask, ratio_logp, old_logp, behaviour_logp, ref_logp, agg,
                                           cost_advantages))
        loss, metrics = res.loss, dict(res.metrics)
        if corr is not None:
            metrics.update(corr.metrics)
        if self.kl_placement == "loss":
            if ref_logp is None:
                raise ValueError("ref_logp: required when kl_placement is 'loss'")
            # bias correction: ratio to the sampling policy; on-policy (no old_logp) sg[log π_θ] itself
            ratio_to = (old_logp if old_logp is not None else logp.detach()) if self.kl_bias_correction else None
            kl_term = aggregate_valid(self.kl_per_token(logp, ref_logp, mask, old_logp=ratio_to),
                                      mask, self.aggregation, constant=c, denominator=denominator, name="kl")
            loss = loss + self.kl_coef * kl_term
            metrics["kl_loss_term"] = kl_term.detach()
        if self.entropy_coef > 0:
            if entropy is None:
                raise ValueError("entropy: required when entropy_coef > 0 (per-token entropy with its gradient)")
            _checks.check_shape("entropy", entropy, tuple(logp.shape), against="logp")
            _checks.check_floating("entropy", entropy)
            ent = aggregate_valid(entropy, mask, self.aggregation, constant=c, denominator=denominator, name="entropy")
            loss = loss - self.entropy_coef * ent
            metrics["entropy_bonus_term"] = ent.detach()
        return LossResult(loss, metrics)

    def value_loss(self, values, targets, mask, *, old_values=None, denominator=None) -> LossResult:
        r"""The critic's loss ``½ (V − sg[R̂])²``, clipped by ``value_clip`` around ``old_values`` (§20.3).

        Token mean over action tokens, in the critic's own backward pass.
        """
        if not self.critic:
            raise ValueError(f"critic: recipe {self.name!r} has no critic")
        return value_loss(values, targets, mask, old_values=old_values, clip_range=self.value_clip, denominator=denominator)

    def dpo_loss(self, chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, chosen_length=None,
                 rejected_length=None, denominator=None) -> LossResult:
        """The preference loss (``dpo_loss_type``); lengths are the response token counts (``ipo``, ``simpo``)."""
        if self.kind != "pairwise":
            raise ValueError(f"loss: recipe {self.name!r} is not a preference-pair recipe")
        return self.term.fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta=self.beta,
                            loss_type=self.dpo_loss_type, label_smoothing=self.label_smoothing,
                            simpo_gamma=self.simpo_gamma, chosen_length=chosen_length,
                            rejected_length=rejected_length, denominator=denominator)

    def distill_loss(self, *, mask, denominator=None, **inputs) -> LossResult:
        """The distillation term on the student's and teacher's logits or hidden states (§14).

        A term with a ``call`` receives ``call(objective, inputs)`` (its own fields, e.g. JSD's β,
        are passed there); otherwise the core function is called with the recipe's aggregation.
        """
        if self.kind != "distill":
            raise ValueError(f"loss: recipe {self.name!r} is not a distillation recipe")
        kw = dict(inputs, mask=mask, aggregation=self.aggregation, constant=self.constant, denominator=denominator)
        return self.term.call(self, kw) if self.term.call is not None else self.term.fn(**kw)


_DOC = """One recipe: every field that changes the estimator, and nothing else.

    Its fields are composed from the :class:`~trajgrad.registry.Param` declarations: the recipe-wide
    ones (:data:`RECIPE_PARAMS`) and those of every registered policy term and advantage estimator,
    each declared in the module of its function. A recipe reads only its entries' fields
    (:meth:`read_fields`); ``replace`` refuses any other.

    Attributes:
{attributes}
    """


def _compose():
    params = _PARAMS
    cls = dataclasses.make_dataclass(
        "Objective", [(p.name, p.annotation) if p.default is _REQUIRED else
                      (p.name, p.annotation, dataclasses.field(default=p.default)) for p in params],
        bases=(_ObjectiveMethods,), frozen=True, namespace={"__module__": __name__})
    cls.__doc__ = _DOC.format(attributes=textwrap.indent(_attributes_doc(params), "    "))
    return cls


_PARAMS = _fields()  # Objective's fields, in order
Objective = _compose()

__all__ = ["Objective", "RECIPE_PARAMS", "KL_PLACEMENTS", "KL_KINDS", "SCHEDULE_FIELDS"]
