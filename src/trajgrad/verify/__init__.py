r"""Check any loss implementation against trajgrad's reference for a recipe (spec §17, §24).

``verify(loss_fn, reference="grpo")`` dispatches on the recipe's kind (its registry entry):

* token-level policy recipes — :mod:`trajgrad.verify.policy`:
  ``loss_fn(logp, old_logp, advantages, mask[, denominator=...][, ref_logp=...])`` with
  ``[B, L]`` tensors (advantages per token; constant within a response for group recipes;
  ``old_logp`` is what the ratio is taken against). The reference is the recipe's policy term
  without KL; ``include_kl=True`` includes the recipe's KL term and passes ``ref_logp=``.
* preference pairs (``dpo``) — :mod:`trajgrad.verify.pairwise`:
  ``loss_fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp)`` with ``[B]``.
* distillation (``opd``) — :mod:`trajgrad.verify.distill`: ``loss_fn(student_logits, teacher_logits, mask)``
  (several teachers, ``loss="multi_teacher"``: ``loss_fn(student_logits, teachers, mask, weights)``).
* ``part="advantages"`` — :mod:`trajgrad.verify.advantages`: an advantage function against the
  recipe's advantage estimator, ``fn(rewards)`` (``[N, G]``) or ``fn(values, rewards, mask)`` (GAE).
* ``reference="logprobs"`` — :mod:`trajgrad.verify.logprobs`:
  ``fn(logits, targets, *, temperature, top_k, top_p)`` against the sampling-transform log-probs.

``loss_fn`` may return a tensor, a ``LossResult`` or a tuple whose first element is the loss.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

from ..objective import Objective, get_recipe
from ._common import Check, VerifyReport, max_deviation
from .advantages import verify_advantages
from .distill import verify_distill
from .logprobs import verify_logprobs
from .pairwise import verify_pairwise
from .policy import verify_policy


def verify(
    loss_fn: Callable,
    reference: "str | Objective" = "grpo",
    *,
    shapes: Sequence[Tuple[int, int]] = ((4, 9), (8, 24), (3, 57)),
    seed: int = 0,
    atol: float = 1e-8,
    rtol: float = 1e-6,
    include_kl: bool = False,
    reference_fn: Optional[Callable] = None,
    part: str = "loss",
    **recipe_overrides: Any,
) -> VerifyReport:
    """Run the §24 battery and a randomized comparison of ``loss_fn`` against a recipe.

    Args:
      loss_fn: the implementation under test (see the module docstring for its signature).
      reference: a recipe name from :data:`trajgrad.objective.RECIPES`, an ``Objective`` (for
        example one built on a user-registered policy term), or ``"logprobs"``.
      shapes: ``(B, L)`` shapes to test; each gets a fresh random batch with ragged masks.
      atol, rtol: tolerance of the comparisons (float64).
      include_kl: compare with the recipe's policy term *plus* its KL term (``ref_logp=`` passed).
      reference_fn: policy recipes only: a callable with ``loss_fn``'s signature used as the
        reference instead of the recipe's loss (for trajgrad called with extra arguments).
      part: ``"loss"`` (default: the recipe's loss) or ``"advantages"`` (``loss_fn`` is an
        advantage function, compared with the recipe's advantage estimator).
      recipe_overrides: fields of the reference recipe to change so that it matches the
        implementation's settings (e.g. ``eps_low=0.1``).
    Returns:
      A :class:`VerifyReport`; ``report.passed`` and ``print(report.table())``.
    """
    if isinstance(reference, str) and reference == "logprobs":
        if recipe_overrides:
            raise ValueError(f"{sorted(recipe_overrides)[0]}: the logprobs reference takes no recipe fields")
        return verify_logprobs(loss_fn, seed=seed)
    if isinstance(reference, Objective):
        recipe = reference.replace(**recipe_overrides) if recipe_overrides else reference
    else:
        recipe = get_recipe(reference, **recipe_overrides)
    if part not in ("loss", "advantages"):
        raise ValueError(f"part: must be 'loss' or 'advantages', got {part!r}")
    if part == "advantages":
        return verify_advantages(loss_fn, recipe, seed=seed)
    if recipe.kind == "pairwise":
        return verify_pairwise(loss_fn, recipe, seed=seed, atol=atol, rtol=rtol)
    if recipe.kind == "distill":
        return verify_distill(loss_fn, recipe, seed=seed, atol=atol, rtol=rtol)
    return verify_policy(loss_fn, recipe, shapes=shapes, seed=seed, atol=atol, rtol=rtol, include_kl=include_kl,
                         reference_fn=reference_fn)


def load_callable(spec: str) -> Callable:
    """Import ``"package.module:function"`` (or a file path ``path/to/file.py:function``)."""
    import importlib
    import importlib.util
    import os

    if ":" not in spec:
        raise ValueError(f"target: expected MODULE:FUNCTION, got {spec!r}")
    mod_name, attr = spec.rsplit(":", 1)
    if mod_name.endswith(".py") or os.path.sep in mod_name:
        path = os.path.abspath(mod_name)
        if not os.path.exists(path):
            raise ValueError(f"target: no such file {mod_name!r}")
        import sys

        module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(module_spec)
        folder = os.path.dirname(path)
        sys.path.insert(0, folder)  # the file's own folder, as when it is run as a script
        try:
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        finally:
            sys.path.remove(folder)
    else:
        module = importlib.import_module(mod_name)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"target: {mod_name} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"target: {spec} is not callable")
    return fn


__all__ = ["verify", "VerifyReport", "Check", "max_deviation", "load_callable", "verify_policy", "verify_pairwise",
           "verify_distill", "verify_logprobs", "verify_advantages"]
