r"""Peers' own loss, advantage and KL code checked against trajgrad's recipes (``trajgrad verify --peer``).

Each :class:`PeerCase` names one function of a peer library (TRL, verl), how to call it
(an adapter in :mod:`trajgrad.peers.trl` / :mod:`trajgrad.peers.verl`, which runs the peer's
code unchanged), and the trajgrad recipe plus the options that reproduce it. Running a case
(:func:`run_case`) puts the peer's function through verify's battery against that recipe:

* **agrees** — the objective checks (value, gradient, ratio one, zero advantage, padding,
  far off-policy; for advantages and KL estimators their value and gradient checks) pass
  against the recipe's defaults;
* **agrees with option X** — they pass once the listed ``Objective`` fields (or call
  arguments) are set: the convention difference that option names;
* **differs** — they fail; the report shows the deviation.

Checks outside the objective (NaN/inf at masked positions, the distributed normalization,
4,096-token responses) are reported per function with one line naming each documented
difference. Advantages are compared at equal and at ragged response lengths; Clip-Cov, whose
tokens are drawn at random, is compared seeded (torch's global RNG seeded before verl's call,
verl's draw reproduced from the same seed; see :func:`trajgrad.peers._compare.cov_random`).
Where the recipe's registry entry cannot take a peer's input (response lengths, a greedy
baseline reward, Σπ²), the case names the trajgrad core function it is compared with
(``PeerCase.ours``). Peer functions without a trajgrad counterpart are listed, with the reason,
in ``_cases.UNCOVERED`` (and those that can be run, in ``_cases.DIFFERS``, are tested to differ). The peers are optional: ``pip install "trajgrad[peers]"`` (see the README for an
environment where verl's pins do not clash with trajgrad's).
"""
from __future__ import annotations

from typing import List, Optional

from ..objective import get_recipe
from . import _cases, _compare, report, trl, verl
from ._case import CaseResult, PeerCase

OBJECTIVE_CHECKS = ("value", "gradient", "ratio_one", "zero_advantage", "padding", "off_policy", "returns",
                    "selection_rule", "selection_count", "gradient_unselected", "selection_law")
# checks whose deviation is a count or a frequency, not a loss or gradient difference (left out of "largest deviation")
COUNT_CHECKS = ("selection_rule", "selection_count", "selection_law")
# a failing non-objective check -> the documented difference it stands for
CONVENTION_NOTES = {
    "masked_nan": "NaN/inf at masked positions reach the loss (masking by multiplication, 0 · inf = NaN)",
    "masked_grad": "non-zero gradient at masked positions",
    "ranks_average": "normalizes within each micro-batch / rank: accumulated or data-parallel updates equal the "
                     "full batch only when micro-batches hold equal counts (trajgrad: a global denominator, §13)",
    "micro_batches": "a global denominator passed in does not make micro-batches sum to the full batch",
    "long_sequence": "non-finite or different on 4,096-token responses whose log-ratio sums exceed exp's range",
    "zero_variance": "a zero-variance group does not get advantage 0",
    "ragged_lengths": "depends on the response lengths (it normalizes over tokens: each response weighs by its "
                      "token count in the batch statistics; trajgrad's estimator weighs every response once)",
    "single_member": "a group of one gets a non-zero advantage",
    "same_tokens": "the same seed selects different tokens: verl permutes the candidates with torch.randperm on "
                   "torch's global RNG, trajgrad draws uniform keys from its own generator; both are uniform subsets "
                   "of the same size (selection_law)",
    "selection_count": "verl selects max(1, ⌊rN⌋) tokens, trajgrad a mass of exactly rN (the last token "
                       "fractionally): they differ when rN is not an integer",
    "padding": "the loss depends on padding: it averages over every row (all-padding rows included) or divides "
               "by the padded length",
}


def cases(peer: str) -> List[PeerCase]:
    """The cases of one peer (``"trl"`` or ``"verl"``)."""
    if peer not in _cases.CASES:
        raise ValueError(f"peer: must be one of {', '.join(_cases.CASES)}, got {peer!r}")
    return list(_cases.CASES[peer])


def run_case(case: PeerCase, *, seed: int = 0) -> CaseResult:
    """Run one case and classify it (see the module docstring)."""
    try:
        fn = case.make()
        recipe = get_recipe(case.recipe, **case.options)
        if case.kind == "policy":
            report = _compare.policy(fn, recipe, case, seed=seed)
        elif case.kind == "advantage":
            report = _compare.advantage(fn, recipe, case, seed=seed)
        elif case.kind == "cov_topk":
            report = _compare.cov_topk(fn, recipe, case, seed=seed)
        elif case.kind == "cov_random":
            report = _compare.cov_random(fn, recipe, case, seed=seed)
        elif case.kind == "critic":
            report = _compare.critic(fn, recipe, case, seed=seed)
        elif case.kind == "token_baseline":
            report = _compare.token_baseline(fn, recipe, case, seed=seed)
        elif case.kind == "pairwise":
            report = _compare.pairwise(fn, recipe, seed=seed)
        elif case.kind == "token_advantage":
            report = _compare.gae(fn, recipe, seed=seed)
        else:
            report = _compare.kl(fn, recipe, seed=seed)
    except Exception as exc:  # an import or call failure is a result, not a crash of the report
        return CaseResult(case, "error", float("inf"), [], [], "", f"{type(exc).__name__}: {exc}")
    failed = [c.name for c in report.checks if c.passed is False]
    conv = set(case.convention_checks) | ({"padding"} if case.denominator == "rows" else set())
    objective = [n for n in failed if n in OBJECTIVE_CHECKS and n not in conv]
    worst = max([c.max_deviation for c in report.checks
                 if c.name in OBJECTIVE_CHECKS and c.name not in conv and c.name not in COUNT_CHECKS] or [0.0])
    if objective:
        status = "differs"
    elif case.options or case.denominator or case.ours_name:
        parts = [f"{k}={v!r}" for k, v in case.options.items()]
        if case.denominator == "rows":
            parts.append("denominator=number of rows")
        if case.ours_name:
            parts.append(case.ours_name)
        status = "agrees with option " + ", ".join(parts)
    else:
        status = "agrees"
    explained = {note.split(":", 1)[0] for note in case.notes}
    conventions = [f"{n}: {CONVENTION_NOTES.get(n, 'fails (see the checks)')}" for n in failed
                   if n not in objective and (n in CONVENTION_NOTES or n not in explained)]
    if case.no_counterpart:
        conventions.insert(0, "no trajgrad counterpart: " + case.no_counterpart)
    return CaseResult(case, status, worst, objective, conventions + list(case.notes), report.table())


def conformance(peer: str, *, recipe: Optional[str] = None, seed: int = 0) -> List[CaseResult]:
    """Every case of ``peer`` (only those mapped to ``recipe`` when given)."""
    chosen = [c for c in cases(peer) if recipe is None or c.recipe == recipe]
    if not chosen:
        raise ValueError(f"--as: no {peer} function is mapped to recipe {recipe!r}")
    return [run_case(c, seed=seed) for c in chosen]


__all__ = ["PeerCase", "CaseResult", "cases", "run_case", "conformance", "OBJECTIVE_CHECKS"]
