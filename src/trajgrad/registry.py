r"""The two registries a recipe is assembled from: policy terms and advantage estimators.

A recipe (:class:`trajgrad.objective.Objective`) names one entry of each. An entry is the
single declaration of an estimator: the core function, how it is called from the recipe's
fields, which fields it reads, which log-probabilities its ratio is taken against, what it
detaches, its paper's default aggregation and its ``explain`` text. ``Objective.policy_loss``,
``explain``, ``explain_diff``, ``verify`` and both trainers read these entries; nothing else
in the library compares a loss or advantage name.

An entry lives in the module of its function (``trajgrad.losses.cispo`` declares CISPO beside
``cispo_loss``): the :class:`Param` declarations of the fields it owns (name, default, check,
one-line doc), its checks, its ``explain`` text and its registration: a policy term with the
:func:`policy_term` decorator on its function (the style of verl's ``@register_policy_loss``; the
function keeps its config-free signature), an advantage estimator with
:func:`register_advantage_estimator` after its function. ``Objective``'s fields are composed from
the declared ``Param``\ s when :mod:`trajgrad.objective` is first imported. Adding an estimator =
its module + its tests. A user registers their own the same way; a field of their own must be
declared before :mod:`trajgrad.objective` is imported (later, only the fields ``Objective``
already has can be read)::

    from trajgrad.registry import Param, finite_positive, policy_term

    SCALE = Param("my_scale", 1.0, "my term's scale.", float, lambda v: finite_positive("my_scale", v))

    @policy_term("my_pg", fields=("my_scale",), params=(SCALE,), ratio="none", detached=(),
                 aggregation="token_mean", text=lambda o: f"x_t = − {o.my_scale:g} · A_t · log π_θ(y_t)",
                 call=lambda o, x: my_pg_loss(x.logp, x.advantages, x.mask, scale=o.my_scale, **x.agg))
    def my_pg_loss(logp, advantages, mask, *, scale, aggregation="token_mean", constant=None, denominator=None):
        ...

    from trajgrad.objective import Objective
    Objective(name="mine", loss="my_pg", advantage="group_std", aggregation="token_mean", group_size=4, my_scale=0.5)

This module is pure bookkeeping: it imports no estimator and nothing from the layers above
(field checks use :mod:`trajgrad._checks`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch

from . import _checks

RATIO_SOURCES = ("none", "old", "behaviour")
TERM_KINDS = ("token", "pairwise", "distill")
ADVANTAGE_LEVELS = ("sequence", "token", "none")
# the extra batch inputs a term of each kind may declare (PolicyTerm.inputs)
TERM_INPUTS = {"token": ("cost_advantages",), "distill": ("teachers",)}


class PolicyInputs(NamedTuple):
    """What :meth:`Objective.policy_loss` hands to a term's ``call``.

    ``ratio_logp`` is the log-probability the term's ratio is taken against, already chosen
    from ``old_logp`` / ``behaviour_logp`` by the term's declared ``ratio`` (``None`` for
    ``ratio="none"``). ``agg`` holds ``aggregation``, ``constant`` and ``denominator``, to be
    passed to the core function as keywords.
    """

    logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ratio_logp: Optional[torch.Tensor]
    old_logp: Optional[torch.Tensor]
    behaviour_logp: Optional[torch.Tensor]
    ref_logp: Optional[torch.Tensor]
    agg: Dict[str, Any]
    cost_advantages: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Param:
    """One field of ``Objective``, declared by the module that reads it.

    Attributes:
      name: the field name (``Objective.<name>``, ``recipe.overrides.<name>`` in a config).
      default: its value when a recipe does not set it (the setting that turns its feature off).
      doc: its description (``Objective``'s docstring and the configuration reference); fields
        that share one description are documented together.
      annotation: its type (``typing.get_type_hints(Objective)`` and the config loader read it).
      check: ``check(value)`` raising ``ValueError`` naming the field when the value is outside
        its domain; run by ``Objective`` on every construction. Checks that relate several
        fields belong to the entry's ``validate``.
    """

    name: str
    default: Any
    doc: str
    annotation: Any = float
    check: Optional[Callable[[Any], None]] = None


def finite_positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a finite number > 0 (>= 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be finite, got {value}")
    _checks.check_positive(name, value, allow_zero=allow_zero)


def flag(name: str, value: Any) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be True or False, got {value!r}")


TextFn = Callable[[Any], str]
Detached = Union[Tuple[str, ...], Callable[[Any], Tuple[str, ...]]]


@dataclass(frozen=True)
class PolicyTerm:
    """One policy term.

    Attributes:
      name: the value of ``Objective.loss`` that selects it.
      fn: the core function (``verify`` and introspection use it).
      call: ``call(objective, inputs: PolicyInputs) -> LossResult`` (token terms); pairwise
        and distill terms are called through ``Objective.dpo_loss`` / ``distill_loss``.
      fields: the ``Objective`` fields the term reads.
      fields_when: optional ``fields_when(objective)``: fields read only in some settings of the
        others (KL-Cov reads ``eps_low`` only with ``kl_cov_base="ppo_clip"``).
      ratio: ``"none"`` (no importance ratio), ``"old"`` (against the log-probs recomputed
        before the update) or ``"behaviour"`` (against the sampler's recorded log-probs).
      detached: what the term stop-gradients, for ``explain`` (a tuple or ``f(objective)``).
      aggregation: its paper's default aggregation.
      text: ``text(objective) -> str``, the per-token term as ``explain`` prints it.
      kind: ``"token"`` (a loss on ``[B, L]`` log-probs), ``"pairwise"`` (preference pairs of
        sequence log-probs, DPO) or ``"distill"`` (full teacher distributions, OPD).
      sequence_advantages: the term needs one advantage per response (GSPO).
      verify_noise: std of the current-vs-old log-prob gap in ``verify``'s random batches
        (small for terms whose trust region is tiny, so that both sides of it are exercised).
      validate: optional ``validate(objective)`` raising ``ValueError`` naming the field.
      params: the :class:`Param` declarations of the fields this term owns (a field read by
        several entries is declared once, by the module they share, and listed by each).
      zero_without_advantage: the term's value and gradient are exactly zero at every token
        of a row whose advantages are all zero, and a row's term reads only that row's
        tensors (and the shared denominator). The trainer then runs such rows forward only,
        without a backward pass (:meth:`Objective.rows_without_gradient`); ``verify`` checks
        the declaration. False (the default) differentiates every row.
      inputs: batch inputs the term reads beyond those of its kind: ``"cost_advantages"`` (a token
        term, :meth:`Objective.policy_loss`'s ``cost_advantages``) or ``"teachers"`` (a distill term,
        several teachers). The trainer supplies ``cost_advantages`` from its ``constraint:`` section
        (the recipe's estimator on the episodes' costs) and no ``teachers``: a config naming a term
        whose inputs it cannot supply is refused at load time, naming the key.
    """

    name: str
    fn: Callable
    fields: Tuple[str, ...]
    ratio: str
    detached: Detached
    aggregation: str
    text: TextFn
    call: Optional[Callable] = None
    kind: str = "token"
    sequence_advantages: bool = False
    verify_noise: float = 0.3
    validate: Optional[Callable[[Any], None]] = None
    zero_without_advantage: bool = False
    params: Tuple[Param, ...] = ()
    fields_when: Optional[Callable[[Any], Tuple[str, ...]]] = None
    inputs: Tuple[str, ...] = ()

    def detached_for(self, objective) -> Tuple[str, ...]:
        return tuple(self.detached(objective)) if callable(self.detached) else tuple(self.detached)


@dataclass(frozen=True)
class AdvantageEstimator:
    """One advantage estimator.

    Attributes:
      name: the value of ``Objective.advantage`` that selects it.
      level: ``"sequence"`` (one advantage per response, from per-response rewards),
        ``"token"`` (per-token advantages from a critic) or ``"none"`` (the loss takes none).
      call: sequence level: ``call(objective, rewards, group_ids) -> GroupAdvantages``;
        token level: ``call(objective, values, rewards, mask, terminated, bootstrap_value)
        -> (advantages, returns)``.
      fields: the ``Objective`` fields it reads.
      fields_when: optional ``fields_when(objective)``: fields read only in some settings.
      text: ``text(objective) -> str`` for ``explain``.
      min_group: the smallest ``group_size`` it accepts (2 for group baselines).
      needs_critic: it needs a value function (``Objective.critic`` must be true).
      validate: optional ``validate(objective)``.
      params: the :class:`Param` declarations of the fields it owns.
    """

    name: str
    level: str
    call: Optional[Callable]
    fields: Tuple[str, ...]
    text: TextFn
    min_group: int = 1
    needs_critic: bool = False
    validate: Optional[Callable[[Any], None]] = None
    params: Tuple[Param, ...] = ()
    fields_when: Optional[Callable[[Any], Tuple[str, ...]]] = None


POLICY_TERMS: Dict[str, PolicyTerm] = {}
ADVANTAGE_ESTIMATORS: Dict[str, AdvantageEstimator] = {}
PARAMS: Dict[str, Param] = {}  # every declared field, in declaration order
_SEALED = []  # non-empty once Objective's fields are composed from PARAMS


def declare(*params: Param) -> Tuple[Param, ...]:
    """Record field declarations (once each; the same declaration again is a no-op).

    ``Objective`` is composed from the declarations when :mod:`trajgrad.objective` is first
    imported; a new field declared after that raises ``ValueError`` (declare it in a module
    imported before :mod:`trajgrad.objective`, or read the fields ``Objective`` already has)."""
    for p in params:
        if not isinstance(p, Param):
            raise ValueError(f"params: expected Param declarations, got {type(p).__name__}")
        if p.name in PARAMS and PARAMS[p.name] is not p:
            raise ValueError(f"params: field {p.name!r} is declared twice (declare it once, where the entries "
                             "that read it can share it)")
        if p.name not in PARAMS and _SEALED:
            raise ValueError(f"params: field {p.name!r} is new, but Objective's fields were composed when "
                             "trajgrad.objective was imported; declare it in a module imported before that")
        PARAMS[p.name] = p
    return params


def seal_params() -> Tuple[Param, ...]:
    """Every declared field, after which no new one can be declared (``Objective`` is composed from them)."""
    _SEALED.append(True)
    return tuple(PARAMS.values())


def register_policy_term(term: PolicyTerm, *, replace: bool = False) -> PolicyTerm:
    """Add a policy term; ``explain``, ``verify`` and the trainers then cover it."""
    if not isinstance(term, PolicyTerm):
        raise ValueError(f"term: expected a PolicyTerm, got {type(term).__name__}")
    if term.ratio not in RATIO_SOURCES:
        raise ValueError(f"term.ratio: must be one of {RATIO_SOURCES}, got {term.ratio!r}")
    if term.kind not in TERM_KINDS:
        raise ValueError(f"term.kind: must be one of {TERM_KINDS}, got {term.kind!r}")
    if term.kind == "token" and term.call is None:
        raise ValueError(f"term.call: token term {term.name!r} needs a call(objective, inputs)")
    if not isinstance(term.zero_without_advantage, bool):
        raise ValueError(f"term.zero_without_advantage: must be True or False, got {term.zero_without_advantage!r}")
    if term.zero_without_advantage and term.kind != "token":
        raise ValueError(f"term.zero_without_advantage: only a token term takes advantages, {term.name!r} is {term.kind}")
    bad = [i for i in term.inputs if i not in TERM_INPUTS.get(term.kind, ())]
    if bad:
        raise ValueError(f"term.inputs: {bad[0]!r} is not an input of a {term.kind} term "
                         f"(known: {', '.join(TERM_INPUTS.get(term.kind, ())) or 'none'})")
    if term.name in POLICY_TERMS and not replace:
        raise ValueError(f"term.name: {term.name!r} is already registered (pass replace=True)")
    declare(*term.params)
    POLICY_TERMS[term.name] = term
    return term


def policy_term(name: str, **entry: Any) -> Callable[[Callable], Callable]:
    """Decorator: register the decorated core function as policy term ``name`` (``entry`` holds
    the other :class:`PolicyTerm` attributes); the function is returned unchanged.

    ::

        @policy_term("cispo", fields=("eps_high",), ratio="old", ..., call=lambda o, x: cispo_loss(...))
        def cispo_loss(logp, old_logp, advantages, mask, *, eps_high=0.28, ...): ...
    """
    def wrap(fn: Callable) -> Callable:
        register_policy_term(PolicyTerm(name=name, fn=fn, **entry))
        return fn
    return wrap


def register_advantage_estimator(est: AdvantageEstimator, *, replace: bool = False) -> AdvantageEstimator:
    """Add an advantage estimator."""
    if not isinstance(est, AdvantageEstimator):
        raise ValueError(f"estimator: expected an AdvantageEstimator, got {type(est).__name__}")
    if est.level not in ADVANTAGE_LEVELS:
        raise ValueError(f"estimator.level: must be one of {ADVANTAGE_LEVELS}, got {est.level!r}")
    if est.level != "none" and est.call is None:
        raise ValueError(f"estimator.call: {est.name!r} needs a call")
    if est.name in ADVANTAGE_ESTIMATORS and not replace:
        raise ValueError(f"estimator.name: {est.name!r} is already registered (pass replace=True)")
    declare(*est.params)
    ADVANTAGE_ESTIMATORS[est.name] = est
    return est


__all__ = [
    "PolicyInputs",
    "PolicyTerm",
    "AdvantageEstimator",
    "POLICY_TERMS",
    "ADVANTAGE_ESTIMATORS",
    "register_policy_term",
    "register_advantage_estimator",
    "policy_term",
    "Param",
    "PARAMS",
    "declare",
    "seal_params",
    "finite_positive",
    "flag",
    "RATIO_SOURCES",
    "TERM_KINDS",
    "ADVANTAGE_LEVELS",
    "TERM_INPUTS",
]
