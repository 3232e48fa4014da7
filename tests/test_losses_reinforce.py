"""Tests for trajgrad.losses.reinforce (spec §2, §4)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.aggregate import MODES, local_count
from trajgrad.losses import LossResult, reinforce_loss

D64 = torch.float64


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


LOGP = [[-1.0, -2.0], [-0.5, -3.0]]
ADV_SEQ = [1.0, -2.0]
MASK = [[1, 1], [1, 0]]


def run(logp, adv, mask, **kw):
    lp = t(logp).requires_grad_(True)
    res = reinforce_loss(lp, adv if isinstance(adv, torch.Tensor) else t(adv), torch.as_tensor(mask), **kw)
    res.loss.backward()
    return res, lp.grad


# Hand values. Valid terms -A*logp: row 0: -(1)(-1) = 1, -(1)(-2) = 2; row 1: -(-2)(-0.5) = -1.
# token_mean: (1+2-1)/3; seq_mean_token_mean: ((1+2)/2 + (-1)/1)/2 = 0.25;
# seq_mean_token_sum: (3 + (-1))/2 = 1; seq_sum_constant with C = L = 2: (2/2)/2 = 0.5.
@pytest.mark.parametrize(
    "mode,expected",
    [("token_mean", 2 / 3), ("seq_mean_token_mean", 0.25), ("seq_mean_token_sum", 1.0), ("seq_sum_constant", 0.5)],
)
def test_hand_values_all_modes(mode, expected):
    res, _ = run(LOGP, ADV_SEQ, MASK, aggregation=mode)
    assert isinstance(res, LossResult)
    assert res.loss.item() == pytest.approx(expected, abs=1e-12)


def test_seq_sum_constant_custom_constant():
    # sum of valid terms = 2, C = 4, D = 2 sequences -> 2 / 4 / 2 = 0.25
    res, _ = run(LOGP, ADV_SEQ, MASK, aggregation="seq_sum_constant", constant=4.0)
    assert res.loss.item() == pytest.approx(0.25, abs=1e-12)


def test_gradient_is_minus_advantage_over_count():
    # d loss / d logp_j = -A_j / D at valid tokens (D = 3), 0 at the masked token.
    _, g = run(LOGP, ADV_SEQ, MASK)
    assert torch.allclose(g, t([[-1 / 3, -1 / 3], [2 / 3, 0.0]]), atol=1e-15)


def test_seq_mean_gradient_weights_by_length():
    # seq_mean_token_mean: -A_i / (G * L_i): row 0: -1/(2*2), row 1: 2/(2*1).
    _, g = run(LOGP, ADV_SEQ, MASK, aggregation="seq_mean_token_mean")
    assert torch.allclose(g, t([[-0.25, -0.25], [1.0, 0.0]]), atol=1e-15)


def test_per_sequence_and_broadcast_advantages_agree():
    a, ga = run(LOGP, ADV_SEQ, MASK)
    b, gb = run(LOGP, [[1.0, 1.0], [-2.0, -2.0]], MASK)
    assert a.loss.item() == b.loss.item()
    assert torch.equal(ga, gb)


def test_advantages_are_detached():
    lp = t(LOGP).requires_grad_(True)
    adv = t(ADV_SEQ).requires_grad_(True)
    reinforce_loss(lp, adv, torch.tensor(MASK)).loss.backward()
    assert adv.grad is None
    assert lp.grad is not None


def test_metrics():
    res, _ = run(LOGP, ADV_SEQ, MASK)
    m = res.metrics
    assert m["tokens"].item() == 3
    assert m["advantage/mean"].item() == pytest.approx((1 + 1 - 2) / 3)
    assert m["logp/mean"].item() == pytest.approx((-1 - 2 - 0.5) / 3)
    assert all(not v.requires_grad for v in m.values())


def test_monte_carlo_pattern_of_section_2():
    # §2 code: loss = sum_t -R * logprob_t for one trajectory (seq_mean_token_sum, one sequence).
    logp = t([[-0.3, -1.2, -0.7]]).requires_grad_(True)
    ret = 2.5
    res = reinforce_loss(logp, t([ret]), torch.ones(1, 3), aggregation="seq_mean_token_sum")
    assert res.loss.item() == pytest.approx(-ret * (-0.3 - 1.2 - 0.7))
    res.loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 3), -ret, dtype=D64))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e30, -7.0])
def test_masked_slots_change_nothing(bad):
    logp = t([[-1.0, -2.0, -0.1], [-0.5, -3.0, -0.2]])
    adv = t([[0.3, -1.0, 2.0], [1.5, 0.2, -0.7]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    for mode in MODES:
        clean, gc = run(logp, adv, mask, aggregation=mode)
        dl = logp.clone()
        da = adv.clone()
        dl[mask == 0] = bad
        da[mask == 0] = bad
        dirty, gd = run(dl, da, mask, aggregation=mode)
        assert torch.isfinite(dirty.loss) and torch.isfinite(gd).all()
        assert dirty.loss.item() == clean.loss.item()
        assert torch.equal(gc, gd)


@pytest.mark.parametrize("mode", MODES)
def test_microbatches_with_global_denominator_equal_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 4, generator=g, dtype=D64)
    adv = torch.randn(5, generator=g, dtype=D64)
    mask = (torch.rand(5, 4, generator=g) > 0.4).long()
    mask[2] = 0  # an empty sequence
    full, gfull = run(logp, adv, mask, aggregation=mode)
    d = local_count(mask, mode)
    lp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5)):
        r = reinforce_loss(lp[rows], adv[rows], mask[rows], aggregation=mode, denominator=d)
        r.loss.backward()
        total += r.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-12)
    assert torch.allclose(lp.grad, gfull, atol=1e-14)


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 4, generator=g, dtype=D64)).requires_grad_(True)
    adv = torch.randn(3, 4, generator=g, dtype=D64)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0]])
    for mode in MODES:
        assert torch.autograd.gradcheck(lambda x: reinforce_loss(x, adv, mask, aggregation=mode).loss, (logp,))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(logp=[-1.0, -2.0]), "logp"),
        (dict(logp=torch.zeros(2, 2, dtype=torch.long)), "logp"),
        (dict(advantages=t([[1.0, 2.0, 3.0]])), "advantages"),
        (dict(advantages=t([1.0, 2.0, 3.0])), "advantages"),
        (dict(advantages=torch.ones(2, 2, 1, dtype=D64)), "advantages"),
        (dict(mask=torch.tensor([[1, 2], [1, 0]])), "mask"),
        (dict(mask=torch.ones(2, 3)), "mask"),
        (dict(logp=t([[math.nan, -1.0], [-1.0, -1.0]])), "logp"),
        (dict(logp=t([[-math.inf, -1.0], [-1.0, -1.0]])), "logp"),
        (dict(advantages=t([[1.0, math.inf], [1.0, 1.0]])), "advantages"),
        (dict(advantages=t([math.nan, 1.0])), "advantages"),
        (dict(aggregation="mean"), "aggregation"),
        (dict(aggregation="token_mean", constant=3.0), "constant"),
        (dict(denominator=0.0), "denominator"),
    ],
)
def test_bad_inputs(kwargs, name):
    args = dict(logp=t([[-1.0, -2.0], [-0.5, -0.1]]), advantages=t([1.0, -1.0]), mask=torch.tensor(MASK))
    args.update(kwargs)
    kw = {k: args.pop(k) for k in ("aggregation", "constant", "denominator") if k in args}
    with pytest.raises(ValueError, match=name):
        reinforce_loss(args["logp"], args["advantages"], args["mask"], **kw)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), l=st.integers(1, 5), mode=st.sampled_from(MODES))
def test_gradient_formula_random(seed, b, l, mode):
    # grad_j = -A_j * w_j with w_j the aggregation weight of token j (1/D, 1/(G L_i), 1/G, 1/(C G)).
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, l, generator=g, dtype=D64)
    adv = torch.randn(b, l, generator=g, dtype=D64)
    mask = torch.rand(b, l, generator=g) > 0.3
    _, grad = run(logp, adv, mask.long(), aggregation=mode)
    lengths = mask.sum(-1, keepdim=True).to(D64)
    n_seq = max(int(mask.any(-1).sum()), 1)
    if mode == "token_mean":
        w = torch.full_like(logp, 1.0 / max(int(mask.sum()), 1))
    elif mode == "seq_mean_token_mean":
        w = 1.0 / (n_seq * lengths.clamp_min(1)).expand(b, l)
    elif mode == "seq_mean_token_sum":
        w = torch.full_like(logp, 1.0 / n_seq)
    elif mode == "token_sum":
        w = torch.ones_like(logp)
    else:
        w = torch.full_like(logp, 1.0 / (l * n_seq))
    expected = torch.where(mask, -adv * w, torch.zeros_like(adv))
    assert torch.allclose(grad, expected, atol=1e-14)
