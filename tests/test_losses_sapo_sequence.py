"""Sequence-level SAPO (sapo_loss(level="sequence")): SAPO's gate on the GSPO sequence ratio."""
import math

import pytest
import torch

from functools import partial

from trajgrad.losses import sapo_loss

sapo_sequence_loss = partial(sapo_loss, level="sequence")

D64 = torch.float64


def _case(seed=0, B=4, L=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 2
    old = logp + 0.4 * torch.randn(B, L, generator=g, dtype=D64)
    adv = torch.randn(B, generator=g, dtype=D64)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[:, 0] = True
    return logp, old, adv, mask


def _trl_sequence_sapo(logp, old, adv, mask, tp=1.0, tn=1.05):
    """TRL 1.16: coef_1 = exp(masked mean log ratio), soft gate, per-token −gate·A, "sapo" reduction."""
    m = mask.to(D64)
    lr = torch.where(mask, logp - old, 0.0)
    coef = torch.exp((lr * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    a = adv[:, None].expand_as(logp)
    temps = torch.where(a > 0, torch.tensor(tp, dtype=D64), torch.tensor(tn, dtype=D64))
    per = -torch.sigmoid(temps * (coef - 1)) * 4 / temps * a
    return ((torch.where(mask, per, 0.0) * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_trl_value_and_gradient(seed):
    logp0, old, adv, mask = _case(seed)
    a = logp0.clone().requires_grad_(True)
    ours = sapo_sequence_loss(a, old, adv, mask).loss
    b = logp0.clone().requires_grad_(True)
    theirs = _trl_sequence_sapo(b, old, adv, mask)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-13)
    (ga,), (gb,) = torch.autograd.grad(ours, a), torch.autograd.grad(theirs, b)
    assert torch.allclose(ga, gb, atol=1e-14)


def test_analytic_gradient():
    logp0, old, adv, mask = _case(3)
    a = logp0.clone().requires_grad_(True)
    sapo_sequence_loss(a, old, adv, mask, tau_pos=2.0, tau_neg=3.0).loss.backward()
    n = mask.sum(-1).to(D64)
    s = torch.exp(torch.where(mask, logp0 - old, 0.0).sum(-1) / n)
    tau = torch.where(adv > 0, 2.0, 3.0)
    p = torch.sigmoid(tau * (s - 1))
    G = mask.shape[0]
    w = -4 * p * (1 - p) * s * adv / n / G  # per token of response i (seq_mean_token_mean)
    expected = torch.where(mask, w[:, None].expand_as(logp0), 0.0)
    assert torch.allclose(a.grad, expected, atol=1e-14)


def test_on_policy_gate_is_one_and_masked_poison_changes_nothing():
    logp0, _, adv, mask = _case(4)
    res = sapo_sequence_loss(logp0, logp0, adv, mask)
    assert res.metrics["gate/mean"].item() == pytest.approx(1.0, abs=1e-15)
    logp0, old, adv, mask = _case(5)
    clean_lp = logp0.clone().requires_grad_(True)
    clean = sapo_sequence_loss(clean_lp, old, adv, mask).loss
    clean.backward()
    for bad in (math.nan, math.inf, -math.inf):
        lp = torch.where(mask, logp0, bad).requires_grad_(True)
        dirty = sapo_sequence_loss(lp, torch.where(mask, old, bad), adv, mask).loss
        dirty.backward()
        assert dirty.item() == clean.item() and torch.equal(lp.grad, clean_lp.grad)


def test_overflowing_ratio_gives_a_constant_not_nan():
    logp = torch.tensor([[0.0, 0.0]], dtype=D64, requires_grad=True)
    old = torch.tensor([[-800.0, -800.0]], dtype=D64)
    res = sapo_sequence_loss(logp, old, torch.tensor([1.0], dtype=D64), torch.ones(1, 2))
    res.loss.backward()
    assert res.loss.item() == pytest.approx(-4.0) and torch.equal(logp.grad, torch.zeros_like(logp))


@pytest.mark.parametrize("kw,name", [(dict(tau_pos=0.0), "tau_pos"), (dict(tau_neg=math.inf), "tau_neg"),
                                     (dict(aggregation="nope"), "aggregation"), (dict(denominator=math.inf), "denominator")])
def test_bad_input(kw, name):
    logp0, old, adv, mask = _case(6)
    with pytest.raises(ValueError, match=name):
        sapo_sequence_loss(logp0, old, adv, mask, **kw)
    with pytest.raises(ValueError, match="old_logp"):
        sapo_sequence_loss(logp0, old[:, :-1], adv, mask)
