"""The ``multi_teacher`` distillation term (§15) from a recipe: the KL direction and the zero-sum rule are recipe
fields (``teacher_direction``, ``teacher_zero_sum``) that reach the loss, ``explain`` prints and ``explain --diff``
names; value and gradient equal a hand-written float64 loop of the paper's equation for each option; NaN/inf at
masked positions change nothing; the docstring's worked examples hold; the batch inputs are checked once, each
error naming the input; a training config naming the term is refused at load time (tests/test_lagrangian_term.py)."""
import math

import pytest
import torch

from trajgrad.losses import multi_teacher_distill_loss, normalized_teacher_weights
from trajgrad.objective import explain, explain_diff, get_recipe

D64 = torch.float64


def _recipe(**kw):
    return get_recipe("opd", loss="multi_teacher", **kw)


def _hand_loss(student, teachers, weights, mask, direction, zero_sum, aggregation="token_mean"):
    """§15 by a loop over positions and teachers: D_n = Σ_i w̃_i KL_i(n), w̃ = w / Σ_j w_j (0 where the sum is 0
    and zero_sum is 'zero'); token_mean: Σ_n D_n / N, seq_mean_token_mean: mean over rows of the row means."""
    B, L, _ = student.shape
    rows = []
    for b in range(B):
        terms = []
        for t in range(L):
            if not bool(mask[b, t]):
                continue
            logp = torch.log_softmax(student[b, t], -1)
            w = [float(weights[i, b, t]) for i in range(len(teachers))]
            total = sum(w)
            if total == 0:
                assert zero_sum == "zero"
                terms.append(0.0 * logp.sum())
                continue
            d = 0.0
            for i, teacher in enumerate(teachers):
                logq = torch.log_softmax(teacher[b, t], -1)
                if direction == "reverse":
                    kl = (logp.exp() * (logp - logq)).sum()
                else:
                    kl = (logq.exp() * (logq - logp)).sum()
                d = d + (w[i] / total) * kl
            terms.append(d)
        rows.append(terms)
    if aggregation == "token_mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / len(flat)
    nonempty = [r for r in rows if r]
    return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)


def _batch(seed, B=3, L=5, V=6, M=3):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, L, V, generator=g, dtype=D64)
    teachers = [torch.randn(B, L, V, generator=g, dtype=D64) for _ in range(M)]
    weights = torch.rand(M, B, L, generator=g, dtype=D64)
    weights[:, 0, 1] = 0.0  # a valid position whose weights sum to 0
    weights[1, 1, :] = 0.0  # one teacher off for a whole row
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 0] = mask[2, 3:] = False
    return student, teachers, weights, mask


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_value_and_gradient_equal_the_hand_loop(direction, aggregation):
    student, teachers, weights, mask = _batch(0)
    o = _recipe(teacher_direction=direction, teacher_zero_sum="zero", aggregation=aggregation)
    s1 = student.clone().requires_grad_(True)
    res = o.distill_loss(student_logits=s1, teachers=teachers, weights=weights, mask=mask)
    (g1,) = torch.autograd.grad(res.loss, s1)
    s2 = student.clone().requires_grad_(True)
    want = _hand_loss(s2, teachers, weights, mask, direction, "zero", aggregation)
    (g2,) = torch.autograd.grad(want, s2)
    assert float(res.loss.detach()) == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-14)
    assert torch.allclose(g1, g2, rtol=1e-10, atol=1e-13)
    assert torch.equal(g1[0, 1], torch.zeros_like(g1[0, 1]))  # the zero-sum position: no gradient ...
    assert f"{direction}_kl" in res.metrics
    # ... and it stays in the denominator: removing it from the mask changes the token mean
    m2 = mask.clone()
    m2[0, 1] = False
    if aggregation == "token_mean":
        other = o.distill_loss(student_logits=student, teachers=teachers, weights=weights, mask=m2).loss
        assert float(other) == pytest.approx(float(res.loss.detach()) * mask.sum().item() / m2.sum().item(), rel=1e-12)


def test_positive_weights_give_the_same_loss_under_either_zero_sum_rule():
    student, teachers, weights, mask = _batch(1)
    weights = weights + 0.1
    a = _recipe(teacher_zero_sum="zero").distill_loss(student_logits=student, teachers=teachers, weights=weights,
                                                      mask=mask).loss
    b = _recipe().distill_loss(student_logits=student, teachers=teachers, weights=weights, mask=mask).loss
    assert torch.equal(a, b)
    assert float(a) == pytest.approx(float(_hand_loss(student, teachers, weights, mask, "reverse", "error")), rel=1e-12)


def test_the_zero_sum_error_names_weights():
    student, teachers, weights, mask = _batch(2)
    with pytest.raises(ValueError, match="^weights: the weights of the teachers sum to 0"):
        _recipe().distill_loss(student_logits=student, teachers=teachers, weights=weights, mask=mask)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_nan_and_inf_at_masked_positions_change_nothing(direction):
    student, teachers, weights, mask = _batch(3)
    o = _recipe(teacher_direction=direction, teacher_zero_sum="zero")
    s1 = student.clone().requires_grad_(True)
    ref = o.distill_loss(student_logits=s1, teachers=teachers, weights=weights, mask=mask).loss
    (g1,) = torch.autograd.grad(ref, s1)
    m3 = mask[..., None].expand_as(student)
    s2 = torch.where(m3, student, torch.tensor(math.nan, dtype=D64)).requires_grad_(True)
    bad_t = [torch.where(m3, t, torch.tensor(v, dtype=D64)) for t, v in zip(teachers, (math.inf, -math.inf, math.nan))]
    bad_w = torch.where(mask, weights, torch.tensor(math.nan, dtype=D64))
    got = o.distill_loss(student_logits=s2, teachers=bad_t, weights=bad_w, mask=mask).loss
    (g2,) = torch.autograd.grad(got, s2)
    assert torch.equal(got, ref)
    assert torch.equal(g2, g1)


@pytest.mark.parametrize("direction,value,grad", [("reverse", 0.143841, 0.274653), ("forward", 0.130812, 0.25)])
def test_the_worked_examples_of_the_docstring(direction, value, grad):
    """One position, one teacher: student logits (0, 0), teacher (log 3, 0); then that position twice with weights
    (1, 0) and zero_sum 'zero': the second contributes 0 and stays in the token mean's denominator."""
    s = torch.zeros(1, 1, 2, dtype=D64, requires_grad=True)
    t = torch.tensor([[[math.log(3.0), 0.0]]], dtype=D64)
    loss = multi_teacher_distill_loss(teachers=[t], student_logits=s, mask=torch.ones(1, 1), direction=direction).loss
    (g,) = torch.autograd.grad(loss, s)
    assert float(loss.detach()) == pytest.approx(value, abs=5e-7)
    assert g[0, 0].tolist() == pytest.approx([-grad, grad], abs=5e-7)
    s2 = torch.zeros(1, 2, 2, dtype=D64, requires_grad=True)
    w = torch.tensor([[[1.0, 0.0]]], dtype=D64)
    o = _recipe(teacher_direction=direction, teacher_zero_sum="zero")
    loss2 = o.distill_loss(student_logits=s2, teachers=[t.expand(1, 2, 2)], weights=w, mask=torch.ones(1, 2)).loss
    (g2,) = torch.autograd.grad(loss2, s2)
    assert float(loss2.detach()) == pytest.approx(value / 2, abs=5e-7)
    assert g2[0, 0].tolist() == pytest.approx([-grad / 2, grad / 2], abs=5e-7) and g2[0, 1].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="^weights:"):
        _recipe(teacher_direction=direction).distill_loss(student_logits=s2, teachers=[t.expand(1, 2, 2)], weights=w,
                                                          mask=torch.ones(1, 2))
    # normalized_teacher_weights' example: w = ((1, 0), (3, 0)) -> ((0.25, 0), (0.75, 0))
    nw = normalized_teacher_weights(torch.tensor([[[1.0, 0.0]], [[3.0, 0.0]]], dtype=D64), torch.ones(1, 2),
                                    zero_sum="zero")
    assert nw.tolist() == [[[0.25, 0.0]], [[0.75, 0.0]]]


def test_explain_prints_the_options_and_diff_names_them():
    base = _recipe()
    text = explain(base)
    assert "KL(π_θ(·|h_t) ‖ sg[π_E_i(·|h_t)])   (reverse KL per teacher" in text
    assert "sum to 0 is an error (teacher_zero_sum 'error')" in text
    o = _recipe(teacher_direction="forward", teacher_zero_sum="zero")
    text = explain(o)
    assert "KL(sg[π_E_i(·|h_t)] ‖ π_θ(·|h_t))   (forward KL per teacher" in text
    assert "gets w̃ = 0: it contributes 0 and stays in the denominator" in text
    head = explain_diff(base, o).split("\n\n")[1]
    assert "  teacher_direction  'reverse'  →  'forward'" in head and "  teacher_zero_sum   'error'  →  'zero'" in head
    head = explain_diff("opd", o).split("\n\n")[1]
    assert "loss" in head and "teacher_direction" in head and "teacher_zero_sum" in head


@pytest.mark.parametrize("field,bad,good", [("teacher_direction", "both", "forward"),
                                            ("teacher_zero_sum", "skip", "zero")])
def test_bad_fields_name_themselves(field, bad, good):
    with pytest.raises(ValueError, match=f"^{field}: must be one of"):
        _recipe(**{field: bad})
    with pytest.raises(ValueError, match=f"^{field}: has no effect"):
        get_recipe("opd", **{field: good})


def test_batch_inputs_are_checked_at_the_boundary():
    student, teachers, weights, mask = _batch(4)
    o = _recipe()
    with pytest.raises(ValueError, match="^teachers: required by loss 'multi_teacher'.*teacher_logits"):
        o.distill_loss(student_logits=student, teacher_logits=teachers[0], mask=mask)
    with pytest.raises(ValueError, match="^teacher_logits: not an input"):
        o.distill_loss(student_logits=student, teachers=teachers, teacher_logits=teachers[0], mask=mask)
    for k, v in (("direction", "forward"), ("zero_sum", "zero"), ("renormalize", False)):
        with pytest.raises(ValueError, match=f"^{k}: set by the recipe"):
            o.distill_loss(student_logits=student, teachers=teachers, mask=mask, **{k: v})
    with pytest.raises(ValueError, match=r"^weights: expected shape \(3, 3, 5\)"):
        o.distill_loss(student_logits=student, teachers=teachers, weights=weights[:2], mask=mask)
    with pytest.raises(ValueError, match="^teachers: empty"):
        o.distill_loss(student_logits=student, teachers=[], mask=mask)
