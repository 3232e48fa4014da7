r"""Coefficients of the objective that are steered or learned beside the policy, outside any loss.

=========================  =================================================================
:mod:`.lagrange`           :class:`LagrangeMultiplier`: :math:`\lambda` of an expected-cost
                           constraint, by projected dual ascent between steps (§22)
:mod:`.teacher_router`     :class:`TeacherRouter`: learned per-position teacher weights
                           :math:`w_i(h)` for multi-teacher distillation (§15)
=========================  =================================================================

Both enter a loss as given quantities (:math:`A_R-\lambda A_C`; the weights of
:func:`trajgrad.losses.multi_teacher_distill_loss`); both are also importable from
:mod:`trajgrad.losses`. The adaptive entropy coefficient is :mod:`trajgrad.entropy_control`.
"""
from .lagrange import LagrangeMultiplier
from .teacher_router import TeacherRouter

__all__ = ["LagrangeMultiplier", "TeacherRouter"]
