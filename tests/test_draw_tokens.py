"""draw_tokens: one token per row from its probabilities, by the inverse CDF (rollout/generation.py)."""
import math

import torch
from hypothesis import given, settings, strategies as st

from trajgrad.rollout.generation import draw_tokens


def test_frequencies_match_the_probabilities():
    """200,000 draws from one distribution with zeros, at both ends and inside: every
    frequency within 5 standard errors of its probability, and no zero-probability token."""
    p = torch.tensor([0.0, 0.05, 0.0, 0.4, 0.15, 1e-3, 0.0, 0.399, 0.0])
    rows = 4000
    probs = p.expand(rows, -1)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(p.numel())
    n = 0
    for _ in range(50):
        counts += torch.bincount(draw_tokens(probs, g), minlength=p.numel()).float()
        n += rows
    freq = counts / n
    se = (p * (1 - p) / n).sqrt()
    assert bool((counts[p == 0] == 0).all())
    assert bool(((freq - p).abs() <= 5 * se + 1e-12).all()), (freq, p)
    # the chi-square statistic of the positive tokens, against its 99.9% quantile for 4 dof (18.47)
    pos = p > 0
    chi2 = float((((counts - n * p) ** 2) / (n * p).clamp_min(1e-30))[pos].sum())
    assert chi2 < 18.47, chi2


def test_unnormalized_rows_and_point_masses():
    probs = torch.tensor([[0.0, 0.0, 3.0], [2.0, 0.0, 0.0], [0.0, 5.0, 0.0], [1.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([draw_tokens(probs, g) for _ in range(2000)])
    assert bool((draws[:, 0] == 2).all()) and bool((draws[:, 1] == 0).all()) and bool((draws[:, 2] == 1).all())
    share = (draws[:, 3] == 2).float().mean().item()  # 1/2 of the mass of an unnormalized row
    assert abs(share - 0.5) < 5 * math.sqrt(0.25 / 2000)


def test_the_generator_fixes_the_draws_and_one_uniform_per_row():
    probs = torch.softmax(torch.randn(16, 50, generator=torch.Generator().manual_seed(2)), -1)
    a = draw_tokens(probs, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    assert torch.equal(a, draw_tokens(probs, g))
    # the same generator state as drawing 16 uniforms: the stream advances by one per row
    g2 = torch.Generator().manual_seed(3)
    torch.rand((16, 1), generator=g2, dtype=torch.float64)
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=g2))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2 ** 31 - 1), st.floats(0.0, 0.95))
def test_never_a_zero_probability_token_or_an_index_out_of_range(rows, vocab, seed, drop):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 4, -1)
    removed = torch.rand(rows, vocab, generator=g) < drop
    removed[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] = False  # one token survives per row
    probs = probs.masked_fill(removed, 0.0)
    for _ in range(5):
        x = draw_tokens(probs, g)
        assert x.shape == (rows,) and x.dtype == torch.long
        assert bool(((x >= 0) & (x < vocab)).all())
        assert bool((probs.gather(1, x[:, None]) > 0).all())


def test_threshold_at_the_total_picks_the_last_positive_token(monkeypatch):
    """u = 0 gives the threshold C_{V-1} exactly: the last token with positive probability,
    not a removed one after it."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(a[0], dtype=k.get("dtype")))
    probs = torch.tensor([[0.2, 0.5, 0.3, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    assert draw_tokens(probs).tolist() == [2, 4]
