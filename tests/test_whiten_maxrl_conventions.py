"""Whitening and MaxRL conventions against hand loops: (x - mu)/(sigma + eps) beside /sqrt(sigma^2 + eps),
empty batches as zeros, MaxRL's eps in the denominator (max or add) and the uncentred form."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.advantages import maxrl_advantages, reinforce_pp_advantages, reinforce_pp_token_advantages
from trajgrad.advantages.baselines import whiten
from trajgrad.losses import reinforce_loss

F64 = torch.float64


def _hand_whiten(xs, eps, placement, unbiased=True):
    """REINFORCE++ reference form: mu, sigma over the list; (x - mu)/(sigma + eps) or /sqrt(sigma^2 + eps)."""
    n = len(xs)
    mu = sum(xs) / n
    var = sum((x - mu) ** 2 for x in xs) / (n - 1 if unbiased else n)
    scale = math.sqrt(var) + eps if placement == "std" else math.sqrt(var + eps)
    return [(x - mu) / scale for x in xs]


@pytest.mark.parametrize("placement", ["variance", "std"])
@pytest.mark.parametrize("unbiased", [True, False])
def test_whiten_placements_match_the_hand_form(placement, unbiased):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    got = whiten(x, mask, eps=0.3, eps_placement=placement, unbiased=unbiased)
    vals = _hand_whiten([float(v) for v in x[mask]], 0.3, placement, unbiased)
    assert torch.allclose(got[mask], torch.tensor(vals, dtype=F64), atol=1e-14)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    # the advantages' gradient path: a REINFORCE loss with them is -sum_t A_t logp_t / N
    logp = torch.zeros(3, 5, dtype=F64, requires_grad=True)
    grad, = torch.autograd.grad(reinforce_loss(logp, got, mask.to(F64)).loss, logp)
    assert not got.requires_grad and torch.allclose(grad, -got / mask.sum(), atol=1e-15)


def test_whiten_docstring_worked_example():
    x = torch.tensor([1.0, 3.0], dtype=F64)
    assert torch.allclose(whiten(x, eps=1.0), torch.tensor([-0.577350, 0.577350], dtype=F64), atol=1e-6)
    assert torch.allclose(whiten(x, eps=1.0, eps_placement="std"), torch.tensor([-0.414214, 0.414214], dtype=F64),
                          atol=1e-6)


def test_reinforce_pp_std_placement_matches_the_hand_form():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=F64)
    got = reinforce_pp_advantages(r, eps=0.5, eps_placement="std").advantages
    assert torch.allclose(got, torch.tensor(_hand_whiten([1.0, 2.0, 3.0, 6.0], 0.5, "std"), dtype=F64), atol=1e-15)
    # the default stays sqrt(var + eps)
    base = reinforce_pp_advantages(r, eps=0.5).advantages
    assert torch.allclose(base, torch.tensor(_hand_whiten([1.0, 2.0, 3.0, 6.0], 0.5, "variance"), dtype=F64))
    tok = reinforce_pp_token_advantages(torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=F64), torch.ones(2, 2),
                                        eps=0.5, eps_placement="std")
    # reward-to-go: [[1, 1], [2, 0]]
    assert torch.allclose(tok.flatten(), torch.tensor(_hand_whiten([1.0, 1.0, 2.0, 0.0], 0.5, "std"), dtype=F64))


@pytest.mark.parametrize("v", [math.nan, math.inf])
def test_empty_batches_give_zeros_by_option_and_the_error_by_default(v):
    x = torch.full((2, 3), v, dtype=F64)
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert torch.equal(whiten(x, none, empty="zeros"), torch.zeros(2, 3, dtype=F64))
    assert torch.equal(whiten(x, none, empty="zeros", shift_mean=False), torch.zeros(2, 3, dtype=F64))
    with pytest.raises(ValueError, match="mask"):
        whiten(x, none)
    one = none.clone()
    one[0, 1] = True
    y = torch.where(one, torch.tensor(4.0, dtype=F64), x)
    assert torch.equal(whiten(y, one, empty="zeros"), torch.zeros(2, 3, dtype=F64))
    assert torch.equal(reinforce_pp_token_advantages(x, none, empty="zeros"), torch.zeros(2, 3, dtype=F64))
    got = reinforce_pp_advantages(torch.tensor([1.0, 2.0], dtype=F64), lengths=torch.zeros(2, dtype=F64),
                                  empty="zeros")
    assert torch.equal(got.advantages, torch.zeros(2, dtype=F64))
    with pytest.raises(ValueError, match="lengths"):
        reinforce_pp_advantages(torch.tensor([1.0, 2.0], dtype=F64), lengths=torch.zeros(2, dtype=F64))


@pytest.mark.parametrize("kw,name", [({"eps_placement": "sum"}, "eps_placement"), ({"empty": "nan"}, "empty")])
def test_whiten_options_name_themselves(kw, name):
    x = torch.tensor([1.0, 2.0], dtype=F64)
    for f in (lambda: whiten(x, **kw), lambda: reinforce_pp_advantages(x, **kw),
              lambda: reinforce_pp_token_advantages(x[None], torch.ones(1, 2), **kw)):
        with pytest.raises(ValueError, match=name):
            f()


@settings(max_examples=40, deadline=None)
@given(xs=st.lists(st.floats(-100, 100), min_size=2, max_size=8), eps=st.floats(1e-6, 1.0))
def test_std_placement_is_an_affine_map_with_scale_sigma_plus_eps(xs, eps):
    x = torch.tensor(xs, dtype=F64)
    a = whiten(x, eps=eps, eps_placement="std")
    sigma = float(x.std()) if float(x.max() - x.min()) > 0 else 0.0
    want = (x - x.mean()) / (sigma + eps) if sigma > 0 else torch.zeros_like(x)
    assert torch.allclose(a, want, atol=1e-9, rtol=1e-9)


# --------------------------------------------------------------------------- MaxRL
def _hand_maxrl(group, eps, mode, centred):
    mean = sum(group) / len(group)
    den = max(mean, eps) if mode == "max" else mean + eps
    if den == 0:
        return [0.0] * len(group)
    return [((r - mean) if centred else r) / den for r in group]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=4, max_size=4), min_size=1,
                     max_size=4),
       eps=st.sampled_from([0.0, 0.1, 0.5]), mode=st.sampled_from(["max", "add"]), centred=st.booleans())
def test_maxrl_conventions_match_the_hand_form(rows, eps, mode, centred):
    got = maxrl_advantages(torch.tensor(rows, dtype=F64), eps=eps, eps_mode=mode, centred=centred).advantages
    want = torch.tensor([_hand_maxrl(r, eps, mode, centred) for r in rows], dtype=F64)
    assert torch.allclose(got, want, atol=1e-12)


def test_maxrl_docstring_worked_example_and_default_is_unchanged():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=F64)
    assert maxrl_advantages(r, eps=0.25).advantages.tolist() == [[3.0, -1.0, -1.0, -1.0]]
    assert maxrl_advantages(r, eps=0.25, eps_mode="add").advantages.tolist() == [[1.5, -0.5, -0.5, -0.5]]
    assert maxrl_advantages(r, centred=False).advantages.tolist() == [[4.0, 0.0, 0.0, 0.0]]
    assert maxrl_advantages(torch.ones(1, 3, dtype=F64), centred=False).advantages.tolist() == [[1.0, 1.0, 1.0]]
    assert torch.equal(maxrl_advantages(r).advantages, maxrl_advantages(r, eps=0.0, eps_mode="max").advantages)


@pytest.mark.parametrize("kw,name", [({"eps": -0.1}, "eps"), ({"eps": math.inf}, "eps"),
                                     ({"eps_mode": "min"}, "eps_mode")])
def test_maxrl_options_name_themselves(kw, name):
    with pytest.raises(ValueError, match=name):
        maxrl_advantages(torch.tensor([[1.0, 0.0]], dtype=F64), **kw)
