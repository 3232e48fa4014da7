"""Tests for trajgrad.losses.gspo (spec §17)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.logprobs import ratios
from trajgrad.aggregate import MODES, aggregate, local_count
from trajgrad.losses import gspo_loss, gspo_token_loss, reinforce_loss

D64 = torch.float64
LOSSES = [gspo_loss, gspo_token_loss]


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


def run(fn, logp, old, adv, mask, **kw):
    lp = t(logp).requires_grad_(True)
    res = fn(lp, t(old), t(adv), torch.as_tensor(mask), **kw)
    res.loss.backward()
    return res, lp.grad


def random_batch(seed, b=4, l=6, scale=0.05, per_seq=True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, l, generator=g, dtype=D64) * 2
    old = logp + scale * torch.randn(b, l, generator=g, dtype=D64)
    mask = (torch.rand(b, l, generator=g) > 0.3).long()
    mask[:, 0] = 1
    adv = torch.randn(b, generator=g, dtype=D64) if per_seq else torch.randn(b, l, generator=g, dtype=D64)
    return logp, old, adv, mask


# §23 tensors with per-sequence advantages [1, -0.5].
OLD = [[-1.00, -0.50], [-0.20, -0.70]]
CUR = [[-0.90, -0.60], [-0.10, -1.00]]
MASK = [[1, 1], [1, 0]]


@pytest.mark.parametrize("fn", LOSSES)
def test_hand_value(fn):
    # s_0 = exp((0.1 - 0.1)/2) = 1; s_1 = exp(0.1/1) = 1.105171 (A < 0: only the low side clips).
    # J = (1*1 + (-0.5)*1.105171) / 2 ; loss = -J = -0.2237073
    res, grad = run(fn, CUR, OLD, [1.0, -0.5], MASK)
    assert res.loss.item() == pytest.approx(-(1.0 - 0.5 * math.exp(0.1)) / 2, abs=1e-12)
    # gradient per token: -(1/G) * s_i A_i / L_i
    expected = t([[-0.5 * 1.0 / 2, -0.5 * 1.0 / 2], [-0.5 * math.exp(0.1) * (-0.5), 0.0]])
    assert torch.allclose(grad, expected, atol=1e-12)


def test_sequence_metrics():
    res, _ = run(gspo_loss, CUR, OLD, [1.0, -0.5], MASK)
    m = res.metrics
    assert m["sequences"].item() == 2 and m["tokens"].item() == 3
    assert m["ratio/max"].item() == pytest.approx(math.exp(0.1))
    assert m["ratio/min"].item() == pytest.approx(1.0)
    # sequence 1 has s > 1 + 4e-4 with A < 0: outside the range, not clipped
    assert m["clip_frac/neg_high"].item() == pytest.approx(0.5)
    assert m["clip_frac"].item() == 0.0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.0, 0.01, 0.3]), mode=st.sampled_from(MODES),
       eps=st.sampled_from([(3e-4, 4e-4), (0.2, 0.2)]))
def test_gspo_and_gspo_token_agree_for_uniform_advantages(seed, scale, mode, eps):
    logp, old, adv, mask = random_batch(seed, scale=scale)
    for a in (adv, adv[:, None].expand(-1, logp.shape[1]).clone()):
        r1, g1 = run(gspo_loss, logp, old, a, mask, eps_low=eps[0], eps_high=eps[1], aggregation=mode)
        r2, g2 = run(gspo_token_loss, logp, old, a, mask, eps_low=eps[0], eps_high=eps[1], aggregation=mode)
        assert abs(r1.loss.item() - r2.loss.item()) < 1e-10
        assert torch.allclose(g1, g2, atol=1e-10, rtol=0)


def test_distinct_token_advantages_give_a_different_gradient():
    logp, old, _, mask = random_batch(7, scale=0.0)
    mask = torch.ones_like(mask)
    adv_tok = t([[1.0, -1.0, 2.0, 0.0, 0.5, 3.0]] * 4)
    mean_adv = adv_tok.mean(-1)
    r_tok, g_tok = run(gspo_token_loss, logp, old, adv_tok, mask)
    r_seq, g_seq = run(gspo_loss, logp, old, mean_adv, mask)
    # the values agree (ratio 1 everywhere) ...
    assert r_tok.loss.item() == pytest.approx(r_seq.loss.item(), abs=1e-12)
    # ... but GSPO-token weights each token by its own advantage: -(1/G)(1/L_i) s_i A_{i,t}
    assert torch.allclose(g_tok, -adv_tok / (4 * 6), atol=1e-14)
    assert not torch.allclose(g_tok, g_seq)


def test_gspo_analytic_gradient_away_from_clipping():
    logp, old, adv, mask = random_batch(11, scale=0.05)
    res, grad = run(gspo_loss, logp, old, adv, mask, eps_low=0.5, eps_high=0.5)
    s = ratios.gspo_sequence_ratio(logp, old, mask)
    lengths = mask.sum(-1).to(D64)
    g_count = int(mask.any(-1).sum())
    # d(-J)/d logp_{i,t} = -(1/G) * s_i A_i / L_i at each valid token
    expected = torch.where(mask.bool(), (-(s * adv / lengths) / g_count)[:, None].expand_as(logp), 0.0)
    assert res.metrics["clip_frac"].item() == 0.0
    assert torch.allclose(grad, expected, atol=1e-13)


def wrong_gspo_token(logp, old, adv, mask, eps_low=3e-4, eps_high=4e-4):
    """GSPO-token with the stop-gradient on s_i missing (the §17 pitfall)."""
    s = ratios.gspo_sequence_ratio(logp, old, mask)  # attached
    carrier = torch.exp(logp - logp.detach())
    ratio = s[:, None] * carrier
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    return aggregate(-surrogate, mask, "seq_mean_token_mean")


def right_gspo_token(logp, old, adv, mask, eps_low=3e-4, eps_high=4e-4):
    """GSPO-token from ratios.gspo_token_ratio and the textbook min/clamp."""
    ratio = ratios.gspo_token_ratio(logp, old, mask)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    return aggregate(-surrogate, mask, "seq_mean_token_mean")


def test_forward_values_are_insufficient():
    logp, old, adv, mask = random_batch(13, scale=0.05, per_seq=False)
    res, grad = run(gspo_token_loss, logp, old, adv, mask, eps_low=0.5, eps_high=0.5)
    lp = logp.clone().requires_grad_(True)
    wrong = wrong_gspo_token(lp, old, adv, mask, 0.5, 0.5)
    wrong.backward()
    assert wrong.item() == pytest.approx(res.loss.item(), abs=1e-12)  # same printed value
    assert not torch.allclose(lp.grad, grad, atol=1e-6)  # different estimator
    # also with uniform advantages the missing stop-gradient changes the gradient
    adv_u = adv[:, :1].expand_as(adv).clone()
    _, grad_u = run(gspo_token_loss, logp, old, adv_u, mask, eps_low=0.5, eps_high=0.5)
    lp2 = logp.clone().requires_grad_(True)
    wrong_gspo_token(lp2, old, adv_u, mask, 0.5, 0.5).backward()
    assert not torch.allclose(lp2.grad, grad_u, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.0, 0.01, 0.3]))
def test_gspo_token_equals_reference_built_on_ratios_module(seed, scale):
    logp, old, adv, mask = random_batch(seed, scale=scale, per_seq=False)
    log_s = ratios.gspo_log_sequence_ratio(logp, old, mask)
    near = torch.stack([(log_s - math.log1p(-0.1)).abs(), (log_s - math.log1p(0.15)).abs()]).min()
    if near < 1e-7:
        return
    res, grad = run(gspo_token_loss, logp, old, adv, mask, eps_low=0.1, eps_high=0.15)
    lp = logp.clone().requires_grad_(True)
    ref = right_gspo_token(lp, old, adv, mask.bool(), 0.1, 0.15)
    ref.backward()
    assert res.loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(grad, lp.grad, atol=1e-12)


@pytest.mark.parametrize("fn", LOSSES)
@pytest.mark.parametrize("shift,adv,zero", [(0.01, 1.0, True), (-0.01, 1.0, False), (-0.01, -1.0, True),
                                            (0.01, -1.0, False)])
def test_sequence_clipping_by_sign(fn, shift, adv, zero):
    # log s = shift on both tokens; eps 3e-4/4e-4 -> s = e^{+-0.01} is outside the range.
    logp = t([[-1.0, -2.0]])
    res, grad = run(fn, logp, logp - shift, [adv], [[1, 1]])
    if zero:
        assert torch.count_nonzero(grad) == 0
        bound = 1 + 4e-4 if adv > 0 else 1 - 3e-4
        assert res.loss.item() == pytest.approx(-bound * adv, rel=1e-12)
    else:
        assert torch.allclose(grad, torch.full_like(grad, -adv * math.exp(shift) / 2), atol=1e-14)


def test_gspo_rejects_per_token_advantages():
    with pytest.raises(ValueError, match="advantages"):
        gspo_loss(t(CUR), t(OLD), t([[1.0, 0.5], [-0.5, 7.0]]), torch.tensor(MASK))
    # constant over the valid tokens (the masked value differs): accepted
    r = gspo_loss(t(CUR), t(OLD), t([[1.0, 1.0], [-0.5, 7.0]]), torch.tensor(MASK))
    assert r.loss.item() == pytest.approx(-(1.0 - 0.5 * math.exp(0.1)) / 2, abs=1e-12)


@pytest.mark.parametrize("fn", LOSSES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 55.0])
def test_masked_slots_change_nothing(fn, bad):
    logp, old, adv, mask = random_batch(17, scale=0.2)
    mask[2] = 0
    for mode in MODES:
        clean, gc = run(fn, logp, old, adv, mask, aggregation=mode, eps_low=0.1, eps_high=0.1)
        dl, do = logp.clone(), old.clone()
        dl[mask == 0] = bad
        do[mask == 0] = bad
        da = adv.clone()
        da[2] = bad  # the advantage of an empty sequence is never used
        dirty, gd = run(fn, dl, do, da, mask, aggregation=mode, eps_low=0.1, eps_high=0.1)
        assert torch.isfinite(dirty.loss) and torch.isfinite(gd).all()
        assert dirty.loss.item() == clean.loss.item()
        assert torch.equal(gc, gd)


@pytest.mark.parametrize("fn", LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_microbatches_with_global_denominator_equal_full_batch(fn, mode):
    logp, old, adv, mask = random_batch(19, b=5, scale=0.2)
    mask[3] = 0
    full, gfull = run(fn, logp, old, adv, mask, aggregation=mode, eps_low=0.1, eps_high=0.1)
    d = local_count(mask, mode)
    lp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5)):
        r = fn(lp[rows], old[rows], adv[rows], mask[rows], aggregation=mode, denominator=d, eps_low=0.1, eps_high=0.1)
        r.loss.backward()
        total += r.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-12)
    assert torch.allclose(lp.grad, gfull, atol=1e-14)


@pytest.mark.parametrize("fn", LOSSES)
def test_gradcheck(fn):
    logp, old, adv, mask = random_batch(23, b=3, l=4, scale=0.02)
    lp = logp.clone().requires_grad_(True)
    for mode in MODES:
        f = lambda x: fn(x, old, adv, mask, aggregation=mode, eps_low=0.5, eps_high=0.5).loss  # noqa: E731
        assert torch.autograd.gradcheck(f, (lp,))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(MODES), token=st.booleans())
def test_ratio_one_gradient_equals_reinforce(seed, mode, token):
    logp, _, adv, mask = random_batch(seed)
    if token:
        adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed), dtype=D64)
    fn = gspo_token_loss if token else gspo_loss
    _, g = run(fn, logp, logp, adv, mask, aggregation=mode)
    lp = logp.clone().requires_grad_(True)
    reinforce_loss(lp, adv, mask, aggregation=mode).loss.backward()
    assert torch.allclose(g, lp.grad, atol=1e-14)


@pytest.mark.parametrize("fn", LOSSES)
@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(old_logp=t([[-1.0, -1.0]])), "old_logp"),
        (dict(logp=t([-1.0, -1.0])), "logp"),
        (dict(logp=t([[-1.0, math.nan], [-1.0, -1.0]])), "logp"),
        (dict(advantages=t([1.0, 2.0, 3.0])), "advantages"),
        (dict(advantages=t([math.nan, 1.0])), "advantages"),
        (dict(mask=torch.tensor([[1, 0.5], [1, 0]])), "mask"),
        (dict(eps_low=0.0), "eps_low"),
        (dict(eps_high=-1e-4), "eps_high"),
        (dict(aggregation="seq_mean"), "aggregation"),
    ],
)
def test_bad_inputs(fn, kwargs, name):
    args = dict(logp=t(CUR), old_logp=t(OLD), advantages=t([1.0, -1.0]), mask=torch.tensor(MASK))
    args.update(kwargs)
    pos = [args.pop(k) for k in ("logp", "old_logp", "advantages", "mask")]
    with pytest.raises(ValueError, match=name):
        fn(*pos, **args)


# ------------------------------------------------------ empty batches (issue: [B, 0])
@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
@pytest.mark.parametrize("shape,adv_1d", [((3, 0), True), ((3, 0), False), ((0, 4), True)])
def test_zero_length_batch_is_a_zero_loss(fn, shape, adv_1d):
    B, L = shape
    logp = torch.zeros(B, L, dtype=torch.float64, requires_grad=True)
    adv = torch.ones(B, dtype=torch.float64) if adv_1d else torch.ones(B, L, dtype=torch.float64)
    res = fn(logp, torch.zeros(B, L, dtype=torch.float64), adv, torch.ones(B, L))
    assert res.loss.item() == 0.0
    res.loss.backward()
    assert logp.grad.shape == (B, L)
    assert res.metrics["tokens"].item() == 0
    assert all(torch.isfinite(v) for v in res.metrics.values())


def _tensor_path_gspo(logp, old, adv, mask, eps_low, eps_high, mode, constant=None, denominator=None):
    """The GSPO loss by tensor operations and autograd (the reference for the closed-form path)."""
    from trajgrad.losses.ppo import _clip_bounds, _clipped_surrogate

    el, eh, lo_b, hi_b = _clip_bounds(eps_low, eps_high)
    m = torch.as_tensor(mask).to(logp.dtype)
    n = m.sum(-1)
    log_s = ((logp - old) * m).sum(-1) / n.clamp_min(1)
    a = adv * (n > 0).to(adv.dtype)
    j = _clipped_surrogate(log_s, a, el, eh, lo_b, hi_b)
    return -aggregate(j[:, None] * m, m.bool(), mode, constant=constant, denominator=denominator)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("denominator", [None, 2.5])
def test_closed_form_path_equals_tensor_path(mode, seed, denominator):
    # ratios on both sides of both bounds, both advantage signs, an empty row, ties at the bounds
    logp, old, adv, mask = random_batch(100 + seed, b=8, l=7, scale=0.3)
    mask[3] = 0
    mask[5] = 0
    mask[5, :2] = 1
    old[5, :2] = logp[5, :2] - math.log1p(0.1)  # log s exactly on the upper bound of eps_high = 0.1
    adv[5] = 1.0 if seed % 2 else -1.0
    constant = 5.0 if mode == "seq_sum_constant" else None
    res, grad = run(gspo_loss, logp, old, adv, mask, aggregation=mode, eps_low=0.1, eps_high=0.1,
                    constant=constant, denominator=denominator)
    lp = t(logp).requires_grad_(True)
    ref = _tensor_path_gspo(lp, t(old), t(adv), mask, 0.1, 0.1, mode, constant=constant, denominator=denominator)
    ref.backward()
    assert res.loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(grad, lp.grad, rtol=1e-12, atol=1e-15)
    # the weighted (tensor) path with unit weights agrees too
    res_w, grad_w = run(gspo_loss, logp, old, adv, mask, aggregation=mode, eps_low=0.1, eps_high=0.1,
                        constant=constant, denominator=denominator, weights=torch.ones(8, 7, dtype=D64))
    assert res_w.loss.item() == pytest.approx(res.loss.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(grad_w, grad, rtol=1e-12, atol=1e-15)
    assert grad[3].abs().sum() == 0 and grad[5, 2:].abs().sum() == 0


def test_closed_form_path_float32_matches_float64():
    logp, old, adv, mask = random_batch(7, b=16, l=50, scale=0.01)
    r64, g64 = run(gspo_loss, logp, old, adv, mask, eps_low=0.004, eps_high=0.004)
    lp = logp.float().requires_grad_(True)
    r32 = gspo_loss(lp, old.float(), adv.float(), mask, eps_low=0.004, eps_high=0.004)
    r32.loss.backward()
    assert r32.loss.dtype == torch.float32 and lp.grad.dtype == torch.float32
    assert r32.loss.item() == pytest.approx(r64.loss.item(), rel=1e-5)
    assert torch.allclose(lp.grad.double(), g64, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("empty_row", [False, True])
def test_metrics_from_the_loss_lists_equal_the_tensor_path(dtype, empty_row):
    # gspo_loss reports the metrics from the per-sequence numbers its loss loop read; the same keys and values
    # as diagnostics' path over the [B, 1] log s (which it takes when quantiles are asked for)
    from trajgrad import diagnostics
    from trajgrad._policy_stats import _fast_policy_metrics

    g = torch.Generator().manual_seed(11)
    B, L = 12, 9
    logp = (-torch.rand(B, L, generator=g, dtype=torch.float64) * 2).to(dtype)
    old = logp + (3e-3 * torch.randn(B, L, generator=g, dtype=torch.float64)).to(dtype)
    adv = torch.randn(B, generator=g, dtype=torch.float64).to(dtype)
    adv[3] = 0.0
    mask = (torch.rand(B, L, generator=g) > 0.2).to(dtype)
    if empty_row:
        mask[5] = 0
    res = gspo_loss(logp.clone().requires_grad_(True), old, adv, mask)
    lengths = mask.sum(-1)
    log_s = ((logp - old) * mask).sum(-1) / lengths.clamp_min(1)
    seq_adv = adv * (lengths > 0).to(dtype)
    nonempty = (lengths > 0)[:, None]
    nf = nonempty.to(dtype)
    with diagnostics.loss_quantiles(False):
        ref = _fast_policy_metrics(log_s[:, None], seq_adv[:, None], nonempty, nf, nf.sum(), lo_b=math.log1p(-3e-4),
                                   hi_b=math.log1p(4e-4), quantiles=False)
    ref["sequences"] = ref.pop("tokens")
    assert set(res.metrics) == set(ref) | {"tokens"}
    for k, v in ref.items():
        assert res.metrics[k].dtype == dtype
        assert res.metrics[k].item() == pytest.approx(v.item(), rel=1e-6 if dtype == torch.float32 else 1e-12), k
    assert res.metrics["clip_frac"].item() > 0  # the clip fractions are exercised
