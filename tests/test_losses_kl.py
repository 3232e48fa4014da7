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


# ------------------------------------------------------------ peer conventions (issue: verl, TRL)
def _verl_low_var_kl(logp, ref):
    """verl 0.9.1 ``low_var_kl`` written out: z clamped to [-20, 20], then k3 clamped to [-10, 10]."""
    kl = torch.clamp(ref - logp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def _zs():
    # z = logp - ref from -25 to 25: in range, k3 > 10 on the left (z < about -2.6), and |z| > 20
    return t([[-25.0, -12.0, -3.0, -2.0, -0.4, 0.0, 0.3, 2.0, 8.0, 15.0, 25.0]])


def test_k3_clamp_matches_verl_value_and_gradient():
    z = _zs()
    ref = torch.full_like(z, -1.0)
    a = (ref + z).requires_grad_(True)
    b = (ref + z).requires_grad_(True)
    ours = kl_estimate(a, ref, kind="k3", clamp=10.0)
    theirs = _verl_low_var_kl(b, ref)
    assert torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    ours.sum().backward()
    theirs.sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12, rtol=0)
    # analytic: 1 - e^{-z} inside, 0 where clipped (k3 > 10)
    k3 = torch.expm1(-z) + z
    expected = torch.where(k3 > 10, torch.zeros_like(z), 1 - torch.exp(-z))
    assert torch.allclose(a.grad, expected, atol=1e-12, rtol=0)
    assert ours.max().item() == 10.0


def test_straight_through_kinds_value_and_gradient():
    z = t([[0.7, -1.3, 0.0, 2.5]])
    ref = t([[-1.0, -2.0, -0.5, -3.0]])
    for kind, value in (("k3+", torch.expm1(-z) + z), ("k1+", z)):
        lp = (ref + z).requires_grad_(True)
        out = kl_estimate(lp, ref, kind=kind)
        assert torch.allclose(out.detach(), value, atol=1e-14), kind
        # the value is bit for bit that of the plain kind
        assert torch.equal(out.detach(), kl_estimate(ref + z, ref, kind=kind[:2])), kind
        out.sum().backward()
        assert torch.allclose(lp.grad, z, atol=1e-14), kind  # gradient of k2 = z
    # verl's form written out: k2 - sg(k2) + sg(k3)
    lp = (ref + z).requires_grad_(True)
    hand = 0.5 * (lp - ref) ** 2
    hand = hand - hand.detach() + (torch.exp(ref - lp) - (ref - lp) - 1).detach()
    (g_hand,) = torch.autograd.grad(hand.sum(), lp)
    lp2 = (ref + z).requires_grad_(True)
    (g_ours,) = torch.autograd.grad(kl_estimate(lp2, ref, kind="k3+").sum(), lp2)
    assert torch.allclose(g_hand, g_ours, atol=1e-14)


def test_k3_plus_with_clamp_clips_the_value_not_the_gradient():
    z = _zs()
    ref = torch.full_like(z, -1.0)
    lp = (ref + z).requires_grad_(True)
    out = kl_estimate(lp, ref, kind="k3+", clamp=10.0)
    assert torch.allclose(out.detach(), _verl_low_var_kl(ref + z, ref), atol=1e-12, rtol=0)
    out.sum().backward()
    assert torch.allclose(lp.grad, z, atol=1e-12)


def test_bias_correction_matches_trl_form_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    logp0 = -torch.rand(3, 5, generator=g, dtype=D64) * 3
    ref = logp0 + 0.5 * torch.randn(3, 5, generator=g, dtype=D64)
    old = logp0 + 0.3 * torch.randn(3, 5, generator=g, dtype=D64)
    a = logp0.clone().requires_grad_(True)
    b = logp0.clone().requires_grad_(True)
    ours = kl_estimate(a, ref, kind="k3", old_logp=old)
    # TRL 1.16 GRPOTrainer: (exp(ref - logp) - (ref - logp) - 1) * exp(logp - old), ratio attached
    theirs = (torch.exp(ref - b) - (ref - b) - 1) * torch.exp(b - old)
    assert torch.allclose(ours, theirs, atol=1e-13, rtol=0)
    ours.sum().backward()
    theirs.sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-13, rtol=0)
    # analytic: rho * (k3 + 1 - e^{-z})
    z, rho = logp0 - ref, torch.exp(logp0 - old)
    assert torch.allclose(a.grad, rho * (torch.expm1(-z) + z + 1 - torch.exp(-z)), atol=1e-13)
    # on-policy the value is k3 but the gradient is not k3's
    lp = logp0.clone().requires_grad_(True)
    on = kl_estimate(lp, ref, kind="k3", old_logp=logp0)
    assert torch.allclose(on.detach(), torch.expm1(-z) + z, atol=1e-14)
    on.sum().backward()
    assert not torch.allclose(lp.grad, 1 - torch.exp(-z))


def test_bias_correction_is_the_exact_reverse_kl_gradient_in_expectation():
    """Σ_y π_old(y) ∇[ρ(y) k3(y)] = ∇ KL(π_θ‖π_ref) over a whole vocabulary (exact, no sampling)."""
    g = torch.Generator().manual_seed(1)
    V = 7
    theta = torch.randn(1, V, generator=g, dtype=D64).requires_grad_(True)
    ref_logits = torch.randn(1, V, generator=g, dtype=D64)
    old_logits = theta.detach() + 0.4 * torch.randn(1, V, generator=g, dtype=D64)
    logp = torch.log_softmax(theta, -1)  # [1, V]: every token of the vocabulary
    ref = torch.log_softmax(ref_logits, -1)
    old = torch.log_softmax(old_logits, -1)
    w = old.exp()
    corrected = (w * kl_estimate(logp, ref, kind="k3", old_logp=old)).sum()
    (g_corr,) = torch.autograd.grad(corrected, theta)
    exact = exact_kl(theta[:, None, :], ref_logits[:, None, :]).sum()
    (g_exact,) = torch.autograd.grad(exact, theta)
    assert torch.allclose(g_corr, g_exact, atol=1e-12)
    # without the correction, tokens drawn from π_old give a different (biased) gradient
    plain = (w * kl_estimate(torch.log_softmax(theta, -1), ref, kind="k3")).sum()
    (g_plain,) = torch.autograd.grad(plain, theta)
    assert (g_plain - g_exact).abs().max().item() > 1e-3


@pytest.mark.parametrize("kw", [dict(kind="k3", clamp=10.0), dict(kind="k3+"), dict(kind="k1+"),
                                dict(kind="k3", old_logp="old"), dict(kind="k3+", clamp=1.0, old_logp="old")])
def test_new_options_ignore_masked_positions(kw):
    logp = t([[-1.0, math.nan], [math.inf, -0.3]])
    ref = t([[-2.0, -math.inf], [math.nan, -0.1]])
    old = t([[-1.2, math.inf], [-math.inf, -0.2]])
    mask = torch.tensor([[1, 0], [0, 1]])
    kw = dict(kw)
    if kw.get("old_logp") == "old":
        kw["old_logp"] = old
    lp = logp.clone().requires_grad_(True)
    out = kl_estimate(lp, ref, mask, **kw)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[1, 0].item() == 0.0
    clean_kw = dict(kw)
    if "old_logp" in clean_kw:
        clean_kw["old_logp"] = t([[-1.2, 0.0], [0.0, -0.2]])
    lc = t([[-1.0, -5.0], [-5.0, -0.3]]).requires_grad_(True)
    clean = kl_estimate(lc, t([[-2.0, -5.0], [-5.0, -0.1]]), mask, **clean_kw)
    clean.sum().backward()
    assert torch.equal(out.detach(), clean.detach())
    assert torch.equal(lp.grad, lc.grad)


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(kind="k4"), "kind"),
        (dict(kind="k3", clamp=0.0), "clamp"),
        (dict(kind="k3", clamp=-1.0), "clamp"),
        (dict(kind="k3", clamp=math.inf), "clamp"),
        (dict(kind="k3", clamp=math.nan), "clamp"),
        (dict(kind="k3", old_logp=t([[-1.0]])), "old_logp"),
        (dict(kind="k3", old_logp=t([[-1.0, math.nan]])), "old_logp"),
    ],
)
def test_new_options_bad_input(kw, name):
    with pytest.raises(ValueError, match=name):
        kl_estimate(t([[-1.0, -2.0]]), t([[-1.5, -1.0]]), **kw)


def test_old_logp_is_detached():
    old = t([[-1.0]]).requires_grad_(True)
    lp = t([[-0.5]]).requires_grad_(True)
    kl_estimate(lp, t([[-0.7]]), kind="k3", old_logp=old).sum().backward()
    assert old.grad is None and lp.grad is not None
