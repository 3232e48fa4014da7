"""verify(): passes trajgrad's own losses, catches planted bugs whose forward values match."""
import functools
from pathlib import Path

import torch

from trajgrad import losses
from trajgrad.objective import RECIPES
from trajgrad.verify import load_callable, max_deviation, verify

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _own(name):
    o = RECIPES[name]
    kw = dict(aggregation=o.aggregation)
    if o.constant is not None:
        kw["constant"] = o.constant
    if o.loss == "reinforce":
        def fn(logp, old_logp, advantages, mask, denominator=None):
            return losses.reinforce_loss(logp, advantages, mask, denominator=denominator, **kw)
        return fn
    if o.loss == "ppo":
        return functools.partial(losses.ppo_clip_loss, eps_low=o.eps_low, eps_high=o.eps_high_, **kw)
    if o.loss == "gspo":
        return functools.partial(losses.gspo_loss, eps_low=o.eps_low, eps_high=o.eps_high_, **kw)
    if o.loss == "gspo_token":
        return functools.partial(losses.gspo_token_loss, eps_low=o.eps_low, eps_high=o.eps_high_, **kw)
    if o.loss == "sapo":
        return functools.partial(losses.sapo_loss, tau_pos=o.tau_pos, tau_neg=o.tau_neg, **kw)
    if o.loss == "sao":
        return functools.partial(losses.sao_dis_loss, eps_low=o.eps_low, eps_high=o.eps_high_, **kw)
    raise AssertionError(name)


def test_own_losses_pass_every_check():
    for name in ["reinforce", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "sapo", "ppo", "sao"]:
        rep = verify(_own(name), name)
        assert rep.passed, (name, rep.table())
        assert all(c.passed for c in rep.checks), rep.table()  # nothing skipped: all take denominator=


def test_user_written_ppo_passes():
    rep = verify(load_callable(f"{EXAMPLES}/my_ppo_clip.py:ppo_loss"), "ppo")
    assert rep.passed, rep.table()


def test_planted_gspo_token_bug_is_caught_by_gradient_not_value():
    rep = verify(load_callable(f"{EXAMPLES}/bugs/gspo_token_detach.py:gspo_token_loss"), "gspo_token")
    by = {c.name: c for c in rep.checks}
    assert not rep.passed
    assert by["value"].passed  # every printed value matches ...
    assert by["gradient"].passed is False and by["gradient"].max_deviation > 1e-3  # ... the gradient does not


def test_local_mean_aggregation_bug_is_caught():
    def token_mean_per_sequence(logp, old_logp, advantages, mask, denominator=None):
        # averages per sequence although the recipe (dapo) aggregates over tokens
        return losses.ppo_clip_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.28,
                                    aggregation="seq_mean_token_mean", denominator=denominator)
    rep = verify(token_mean_per_sequence, "dapo")
    assert not rep.passed


def test_masked_nan_leak_is_caught():
    def leaky(logp, old_logp, advantages, mask):
        ratio = torch.exp(logp - old_logp.detach())
        return -(ratio * advantages * mask).sum() / mask.sum()  # multiplies NaN by 0
    rep = verify(leaky, "ppo")
    by = {c.name: c for c in rep.checks}
    assert by["masked_nan"].passed is False


def test_dpo_and_opd_references():
    rep = verify(functools.partial(losses.dpo_loss, beta=0.1), "dpo")
    assert rep.passed, rep.table()

    def wrong_beta(c, r, rc, rr):
        return losses.dpo_loss(c, r, rc, rr, beta=0.2)
    assert not verify(wrong_beta, "dpo").passed


def test_opd_reference_accepts_exact_kl_and_rejects_sampled_token_kl():
    def exact(student_logits, teacher_logits, mask):
        return losses.reverse_kl_distill_loss(student_logits=student_logits, teacher_logits=teacher_logits, mask=mask)
    rep = verify(exact, "opd")
    assert rep.passed, rep.table()

    def sampled(student_logits, teacher_logits, mask):
        # the sampled-token approximation at the argmax token: a different objective (§14)
        y = student_logits.detach().argmax(-1, keepdim=True)
        s = torch.log_softmax(student_logits, -1).gather(-1, y).squeeze(-1)
        t = torch.log_softmax(teacher_logits, -1).gather(-1, y).squeeze(-1)
        return losses.sampled_token_kl(s, t, mask).loss
    assert not verify(sampled, "opd").passed


def test_a_raising_implementation_fails_cleanly():
    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    for ref in ("ppo", "dpo", "opd"):
        rep = verify(broken, ref)
        assert not rep.passed and "boom" in rep.table()


def test_max_deviation_is_inf_unless_shapes_match_and_differences_are_finite():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert max_deviation(a, a + torch.tensor([0.0, -0.5, 0.25])) == 0.5
    assert max_deviation(torch.zeros(0), torch.zeros(0)) == 0.0
    assert max_deviation(a, a[:2]) == float("inf")
    assert max_deviation(a, torch.tensor([1.0, float("nan"), 3.0])) == float("inf")
    assert max_deviation(a, torch.tensor([1.0, 2.0, float("inf")])) == float("inf")
