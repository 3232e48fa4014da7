"""Tests for trajgrad.losses.kl (spec §9, §14, §24; Schulman's k1/k2/k3)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import exact_kl, kl_estimate

D64 = torch.float64


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


def test_hand_values():
    # z = logp - ref = -1 - (-1.5) = 0.5 ; k1 = 0.5, k2 = 0.125, k3 = e^{-0.5} - 1 + 0.5
    logp, ref = t([[-1.0]]), t([[-1.5]])
    assert kl_estimate(logp, ref, kind="k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, kind="k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, kind="k3").item() == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-15)
    assert kl_estimate(logp, ref).item() == pytest.approx(0.5)  # default k1
    # negative z: k1 negative, k2 and k3 positive
    logp, ref = t([[-2.0]]), t([[-1.0]])
    assert kl_estimate(logp, ref, kind="k1").item() == pytest.approx(-1.0)
    assert kl_estimate(logp, ref, kind="k3").item() == pytest.approx(math.e - 2.0, abs=1e-15)


def test_per_token_gradients():
    # d k1/d logp = 1 ; d k2/d logp = z ; d k3/d logp = 1 - e^{-z}
    z = t([[0.5, -1.0, 0.0]])
    ref = t([[-1.0, -0.5, -2.0]])
    for kind, expected in (("k1", torch.ones_like(z)), ("k2", z), ("k3", 1 - torch.exp(-z))):
        lp = (ref + z).requires_grad_(True)
        kl_estimate(lp, ref, kind=kind).sum().backward()
        assert torch.allclose(lp.grad, expected, atol=1e-14), kind


@settings(max_examples=40, deadline=None)
@given(a=st.floats(-30, 0), b=st.floats(-30, 0))
def test_k2_k3_non_negative(a, b):
    for kind in ("k2", "k3"):
        assert kl_estimate(t([[a]]), t([[b]]), kind=kind).item() >= 0.0


def test_masked_positions_are_zero_and_carry_no_gradient():
    logp = t([[-1.0, math.nan], [math.inf, -0.3]])
    ref = t([[-2.0, -math.inf], [math.nan, -0.1]])
    mask = torch.tensor([[1, 0], [0, 1]])
    for kind in ("k1", "k2", "k3"):
        lp = logp.clone().requires_grad_(True)
        out = kl_estimate(lp, ref, mask, kind=kind)
        assert torch.isfinite(out).all()
        assert out[0, 1].item() == 0.0 and out[1, 0].item() == 0.0
        out.sum().backward()
        assert torch.isfinite(lp.grad).all()
        assert lp.grad[0, 1].item() == 0.0 and lp.grad[1, 0].item() == 0.0
        clean = kl_estimate(t([[-1.0, -5.0], [-5.0, -0.3]]), t([[-2.0, -5.0], [-5.0, -0.1]]), mask, kind=kind)
        assert torch.equal(out.detach(), clean)


def test_ref_is_detached():
    ref = t([[-1.0]]).requires_grad_(True)
    lp = t([[-0.5]]).requires_grad_(True)
    kl_estimate(lp, ref, kind="k3").sum().backward()
    assert ref.grad is None and lp.grad is not None


# -------------------------------------------------------------------------- exact_kl
def test_exact_kl_hand_value():
    # p = [1/2, 1/2], q = [1/4, 3/4]: KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    lp = t([[[0.0, 0.0]]])
    lq = t([[[0.0, math.log(3.0)]]])
    assert exact_kl(lp, lq).item() == pytest.approx(0.5 * math.log(4.0 / 3.0), abs=1e-15)


def test_exact_kl_with_minus_inf_support():
    # p = softmax([0, -inf, 0]) = [1/2, 0, 1/2], q uniform on 3: KL = ln(3/2)
    lp = t([[[0.0, -math.inf, 0.0]]]).requires_grad_(True)
    lq = t([[[0.0, 0.0, 0.0]]]).requires_grad_(True)
    kl = exact_kl(lp, lq)
    assert kl.item() == pytest.approx(math.log(1.5), abs=1e-15)
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all() and torch.isfinite(lq.grad).all()
    # d KL / d logits_q = q - p = [1/3 - 1/2, 1/3, 1/3 - 1/2]
    assert torch.allclose(lq.grad, t([[[-1 / 6, 1 / 3, -1 / 6]]]), atol=1e-14)


def test_exact_kl_gradient_wrt_logits():
    # d KL(p||q) / d logits_p_v = p_v (log p_v - log q_v - KL);  d / d logits_q_v = q_v - p_v
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 5, generator=g, dtype=D64).requires_grad_(True)
    b = torch.randn(2, 3, 5, generator=g, dtype=D64).requires_grad_(True)
    kl = exact_kl(a, b)
    kl.sum().backward()
    p, q = a.detach().softmax(-1), b.detach().softmax(-1)
    expected_a = p * (p.log() - q.log() - kl.detach()[..., None])
    assert torch.allclose(a.grad, expected_a, atol=1e-14)
    assert torch.allclose(b.grad, q - p, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.0, 20.0), temp=st.floats(0.1, 4.0))
def test_exact_kl_non_negative_and_zero_for_equal_logits(seed, scale, temp):
    g = torch.Generator().manual_seed(seed)
    a = scale * torch.randn(2, 3, 7, generator=g, dtype=D64)
    b = scale * torch.randn(2, 3, 7, generator=g, dtype=D64)
    assert (exact_kl(a, b, temperature=temp) >= -1e-12).all()
    assert exact_kl(a, a.clone(), temperature=temp).abs().max().item() <= 1e-12
    # shifting logits by a constant per position does not change the distribution
    assert exact_kl(a, a + 3.0, temperature=temp).abs().max().item() <= 1e-12


def test_exact_kl_temperature():
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(1, 2, 4, generator=g, dtype=D64) for _ in range(2))
    assert torch.allclose(exact_kl(a, b, temperature=2.0), exact_kl(a / 2.0, b / 2.0), atol=1e-15)


def test_exact_kl_masked_positions():
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(2, 2, 4, generator=g, dtype=D64) for _ in range(2))
    mask = torch.tensor([[1, 0], [0, 1]])
    ac = a.clone().requires_grad_(True)
    clean = exact_kl(ac, b, mask)
    clean.sum().backward()
    ad, bd = a.clone(), b.clone()
    ad[0, 1] = math.nan
    ad[1, 0, 1] = math.inf
    bd[0, 1, 0] = -math.inf
    bd[1, 0] = math.nan
    ad.requires_grad_(True)
    dirty = exact_kl(ad, bd, mask)
    dirty.sum().backward()
    assert torch.equal(clean.detach(), dirty.detach())
    assert dirty[0, 1].item() == 0.0 and dirty[1, 0].item() == 0.0
    assert torch.isfinite(ad.grad).all() and torch.equal(ac.grad, ad.grad)


def test_exact_kl_gradcheck():
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(2, 2, 3, generator=g, dtype=D64).requires_grad_(True) for _ in range(2))
    mask = torch.tensor([[1, 1], [0, 1]])
    assert torch.autograd.gradcheck(lambda x, y: exact_kl(x, y, mask, temperature=0.7), (a, b))


# ------------------------------------------------- sampled estimators vs exact KL
LOGITS_P = [1.0, 0.2, -0.5, 0.0, -1.5]
LOGITS_Q = [0.3, 0.6, -0.2, -1.0, 0.1]


def test_monte_carlo_k1_k3_approach_exact_kl():
    p_logits, q_logits = t(LOGITS_P), t(LOGITS_Q)
    exact = exact_kl(p_logits[None, None], q_logits[None, None]).item()
    log_p, log_q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    n = 200_000
    g = torch.Generator().manual_seed(1234)
    samples = torch.multinomial(log_p.exp(), n, replacement=True, generator=g)
    logp, ref = log_p[samples][None], log_q[samples][None]
    for kind in ("k1", "k3"):
        est = kl_estimate(logp, ref, kind=kind)
        mean, se = est.mean().item(), est.std().item() / math.sqrt(n)
        # tolerance: 5 standard errors of the Monte Carlo mean (both estimators are unbiased)
        assert abs(mean - exact) < 5 * se, (kind, mean, exact, se)
        assert se < 0.01
    # k2 is biased: its mean differs from the KL by much more than its standard error here
    k2 = kl_estimate(logp, ref, kind="k2")
    assert abs(k2.mean().item() - exact) > 5 * k2.std().item() / math.sqrt(n)


def expected_estimator_gradient(kind):
    """E_{y~pi}[grad_theta k(y)] computed exactly over the vocabulary (pi = softmax(theta))."""
    theta = t(LOGITS_P).requires_grad_(True)
    log_q = t(LOGITS_Q).log_softmax(-1)
    log_p = theta.log_softmax(-1)
    weights = log_p.detach().exp()  # the sampling distribution is not differentiated
    per_token = kl_estimate(log_p[None], log_q[None], kind=kind)[0]
    (weights * per_token).sum().backward()
    return theta.grad


def test_expected_gradients_documented_in_module():
    theta = t(LOGITS_P).requires_grad_(True)
    q_logits = t(LOGITS_Q)
    (g_reverse,) = torch.autograd.grad(exact_kl(theta[None, None], q_logits[None, None]).sum(), theta)
    (g_forward,) = torch.autograd.grad(exact_kl(q_logits[None, None], theta[None, None]).sum(), theta)
    assert torch.allclose(expected_estimator_gradient("k1"), torch.zeros(5, dtype=D64), atol=1e-15)
    assert torch.allclose(expected_estimator_gradient("k2"), g_reverse, atol=1e-14)
    assert torch.allclose(expected_estimator_gradient("k3"), g_forward, atol=1e-14)
    assert not torch.allclose(g_reverse, g_forward, atol=1e-3)


# ---------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: kl_estimate(t([[-1.0]]), t([[-1.0]]), kind="k4"), "kind"),
        (lambda: kl_estimate(t([-1.0]), t([-1.0])), "logp"),
        (lambda: kl_estimate(t([[-1.0]]), t([[-1.0, -2.0]])), "ref_logp"),
        (lambda: kl_estimate(t([[math.nan]]), t([[-1.0]])), "logp"),
        (lambda: kl_estimate(t([[-1.0]]), t([[math.inf]])), "ref_logp"),
        (lambda: kl_estimate(t([[-1.0]]), t([[-1.0]]), torch.tensor([[2]])), "mask"),
        (lambda: kl_estimate(t([[-1.0]]), t([[-1.0]]), torch.tensor([[1, 1]])), "mask"),
        (lambda: exact_kl(t([[0.0, 1.0]]), t([[0.0, 1.0]])), "logits_p"),
        (lambda: exact_kl(t([[[0.0, 1.0]]]), t([[[0.0, 1.0, 2.0]]])), "logits_q"),
        (lambda: exact_kl(t([[[math.nan, 1.0]]]), t([[[0.0, 1.0]]])), "logits_p"),
        (lambda: exact_kl(t([[[0.0, 1.0]]]), t([[[math.inf, 1.0]]])), "logits_q"),
        (lambda: exact_kl(t([[[-math.inf, -math.inf]]]), t([[[0.0, 1.0]]])), "logits_p"),
        (lambda: exact_kl(t([[[0.0, 1.0]]]), t([[[0.0, 1.0]]]), temperature=0.0), "temperature"),
        (lambda: exact_kl(t([[[0.0, 1.0]]]), t([[[0.0, 1.0]]]), torch.tensor([[1, 0]])), "mask"),
        (lambda: exact_kl(torch.zeros(1, 1, 2, dtype=torch.long), t([[[0.0, 1.0]]])), "logits_p"),
    ],
)
def test_bad_inputs(call, name):
    with pytest.raises(ValueError, match=name):
        call()
