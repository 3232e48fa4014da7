"""Tests for trajgrad.logprobs: alignment (§4), the sampling distribution (§7), entropy."""
from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajgrad
from trajgrad.logprobs import sampling as lp_mod
from trajgrad.logprobs import (
    entropy,
    sampling_logits,
    shift_logits_and_targets,
    shift_mask,
    token_logprobs,
)
from trajgrad.logprobs.ratios import token_log_ratio

hf = pytest.importorskip("transformers.generation.logits_process")

INF = math.inf


# --------------------------------------------------------------------------- helpers


def hf_warp(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """The generate() warper pipeline (temperature, top-k, top-p; min_tokens_to_keep=1)."""
    vocab = logits.shape[-1]
    scores = logits.reshape(-1, vocab)
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()  # generate() upcasts the step logits to float32
    dummy_ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    procs = []
    if temperature != 1.0:
        procs.append(hf.TemperatureLogitsWarper(float(temperature)))
    if top_k is not None:
        procs.append(hf.TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        procs.append(hf.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    for proc in procs:
        scores = proc(dummy_ids, scores)
    return scores.reshape(*logits.shape[:-1], vocab)


def make_logits(kind: str, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = 3.0 * torch.randn(shape, generator=g, dtype=torch.float64)
    elif kind == "ties":  # few distinct values: many ties at the top-k / top-p boundaries
        x = torch.randint(-3, 3, shape, generator=g).to(torch.float64)
    elif kind == "peaked":
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x[..., 0] += 12.0
    else:
        raise AssertionError(kind)
    return x.to(dtype)


COMBOS = [
    (1.0, None, None),
    (0.7, None, None),
    (1.5, None, None),
    (1.0, 5, None),
    (1.0, 1, None),
    (1.0, 64, None),  # k > V keeps everything
    (1.0, None, 0.9),
    (1.0, None, 0.3),
    (1.0, None, 1.0),
    (1.0, None, 0.01),
    (0.8, 10, 0.8),
    (1.3, 3, 0.5),
    (0.6, 20, 0.95),
]


# --------------------------------------------------------------------------- §4 alignment


def test_shift_alignment_hand_example():
    # V = 3, input_ids = [0, 2, 1]. Row 0 predicts token 2, row 1 predicts token 1; the last
    # row predicts nothing and is NaN on purpose: the shift must drop it.
    input_ids = torch.tensor([[0, 2, 1]])
    logits = torch.tensor(
        [[[0.0, 0.0, math.log(2.0)],  # probs [1/4, 1/4, 1/2]
          [math.log(3.0), 0.0, 0.0],  # probs [3/5, 1/5, 1/5]
          [math.nan, math.nan, math.nan]]],
        dtype=torch.float64,
    )
    lg, tg = shift_logits_and_targets(logits, input_ids)
    assert lg.shape == (1, 2, 3) and tg.tolist() == [[2, 1]]
    got = token_logprobs(lg, tg)
    expected = torch.tensor([[math.log(0.5), math.log(0.2)]], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    # the spec's own snippet (§4)
    spec = lg.log_softmax(-1).gather(-1, tg[..., None]).squeeze(-1)
    torch.testing.assert_close(got, spec, rtol=0, atol=1e-15)

    # a prompt token (mask 0) followed by two action tokens
    assert shift_mask(torch.tensor([[0, 1, 1]])).tolist() == [[1, 1]]
    assert shift_mask(torch.tensor([[1, 0, 1]], dtype=torch.bool)).dtype == torch.bool


def test_shift_bad_inputs():
    logits = torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match="input_ids"):
        shift_logits_and_targets(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        shift_logits_and_targets(logits, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="logits"):
        shift_logits_and_targets(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="mask"):
        shift_mask(torch.tensor([[0, 2, 1]]))
    with pytest.raises(ValueError, match="mask"):
        shift_mask(torch.tensor([0, 1, 1]))


# --------------------------------------------------------------------------- equality with generate()


@pytest.mark.parametrize("temperature,top_k,top_p", COMBOS)
@pytest.mark.parametrize("kind", ["randn", "ties", "peaked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_hf_warpers(temperature, top_k, top_p, kind, dtype):
    B, L, V = 3, 4, 50
    logits = make_logits(kind, (B, L, V), dtype, seed=zlib.crc32(repr((kind, temperature, top_k, top_p)).encode()) % 1000)
    ref = hf_warp(logits, temperature, top_k, top_p)
    ours = sampling_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert ours.dtype == dtype
    assert torch.equal(ours, ref)  # same support, same values, bit for bit

    g = torch.Generator().manual_seed(7)
    targets = torch.randint(0, V, (B, L), generator=g)
    expected = ref.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    got, in_support = token_logprobs(
        logits, targets, temperature=temperature, top_k=top_k, top_p=top_p, return_support=True
    )
    assert torch.equal(got, expected)  # same distribution, same kernels: bit for bit
    assert torch.equal(in_support, torch.isfinite(expected))


def test_matches_hf_when_support_is_computed_in_chunks(monkeypatch):
    V = 40
    logits = make_logits("ties", (5, 7, V), torch.float32, seed=3)
    ref = hf_warp(logits, 0.9, 12, 0.7)
    monkeypatch.setattr(lp_mod, "_SUPPORT_CHUNK_ELEMENTS", 3 * V)  # 3 rows per chunk
    assert torch.equal(sampling_logits(logits, temperature=0.9, top_k=12, top_p=0.7), ref)


def test_half_precision_matches_generate_float32_upcast():
    logits = make_logits("randn", (2, 3, 30), torch.bfloat16, seed=1)
    ref = hf_warp(logits, 0.8, 7, 0.9)  # upcasts like generate()
    ours = sampling_logits(logits, temperature=0.8, top_k=7, top_p=0.9)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, ref)
    out = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.8)
    assert out.dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.7]),
    top_k=st.one_of(st.none(), st.integers(1, 30)),
    top_p=st.one_of(st.none(), st.floats(0.01, 1.0)),
    kind=st.sampled_from(["randn", "ties", "peaked"]),
)
def test_matches_hf_property(seed, temperature, top_k, top_p, kind):
    logits = make_logits(kind, (2, 3, 25), torch.float32, seed=seed)
    ref = hf_warp(logits, temperature, top_k, top_p)
    assert torch.equal(sampling_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p), ref)


# --------------------------------------------------------------------------- hand-derived truncation


def test_top_k_keeps_boundary_ties():
    # logits [2, 2, 2, 0], top_k = 2: the 2nd largest is 2, and every logit >= 2 is kept,
    # so the support is {0, 1, 2} with probability 1/3 each.
    logits = torch.tensor([[[2.0, 2.0, 2.0, 0.0]] * 4], dtype=torch.float64)
    targets = torch.tensor([[0, 1, 2, 3]])
    got, in_support = token_logprobs(logits, targets, top_k=2, return_support=True)
    third = math.log(1.0 / 3.0)
    assert got[0, :3].tolist() == pytest.approx([third] * 3, abs=1e-15)
    assert got[0, 3].item() == -INF
    assert in_support.tolist() == [[True, True, True, False]]


def test_top_p_in_support_flag_hand_example():
    # probs [0.5, 0.3, 0.2], top_p = 0.75. Ascending cumulative mass [0.2, 0.5, 1.0];
    # tokens with mass <= 1 - 0.75 = 0.25 are dropped: token 2 only. Renormalized over
    # {0, 1}: [0.5 / 0.8, 0.3 / 0.8] = [0.625, 0.375].
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    logits = probs.log().expand(1, 3, 3).clone()
    targets = torch.tensor([[0, 1, 2]])
    got, in_support = token_logprobs(logits, targets, top_p=0.75, return_support=True)
    assert got[0, 0].item() == pytest.approx(math.log(0.625), abs=1e-14)
    assert got[0, 1].item() == pytest.approx(math.log(0.375), abs=1e-14)
    assert got[0, 2].item() == -INF
    assert in_support.tolist() == [[True, True, False]]


def test_top_p_boundary_mass_exactly_p():
    # Uniform over 4 tokens: probabilities are exactly 1/4 and the ascending cumulative mass
    # is exactly [0.25, 0.5, 0.75, 1]. top_p = 0.75 drops mass <= 0.25 (one token) and keeps
    # 3 tokens of total mass 0.75 >= p; top_p = 0.5 keeps 2. Which of the tied tokens go
    # is decided by the sort order, as in generate().
    logits = torch.zeros(1, 1, 4, dtype=torch.float64)
    for p, size in [(0.75, 3), (0.5, 2), (0.25, 1), (1.0, 4)]:
        ours = sampling_logits(logits, top_p=p)
        assert int((ours > -INF).sum()) == size
        assert torch.equal(ours, hf_warp(logits, 1.0, None, p))
        kept = token_logprobs(logits.expand(1, 4, 4), torch.arange(4)[None], top_p=p)
        assert kept[torch.isfinite(kept)].tolist() == pytest.approx([math.log(1.0 / size)] * size, abs=1e-15)


def test_temperature_before_top_p_and_top_k_before_top_p():
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    logits = probs.log().expand(1, 1, 3).clone()
    y = torch.tensor([[2]])
    # T = 4: q ∝ p^(1/4) ≈ [0.3738, 0.3290, 0.2972]; ascending cumulative [0.297, 0.626, 1]
    # exceeds 0.25 at once, so top_p = 0.75 keeps all three; at T = 1 token 2 is dropped.
    _, s4 = token_logprobs(logits, y, temperature=4.0, top_p=0.75, return_support=True)
    _, s1 = token_logprobs(logits, y, temperature=1.0, top_p=0.75, return_support=True)
    assert s4.item() and not s1.item()
    q = probs ** 0.25 / (probs ** 0.25).sum()
    got = token_logprobs(logits, y, temperature=4.0, top_p=0.75)
    assert got.item() == pytest.approx(math.log(q[2].item()), abs=1e-14)
    # top_k = 2 first renormalizes to [0.625, 0.375]; then top_p = 0.6 drops mass <= 0.4,
    # i.e. token 1, leaving {0}. (top-p first would keep {0, 1}.)
    targets = torch.tensor([[0, 1, 2]])
    lg3 = probs.log().expand(1, 3, 3).clone()
    got, s = token_logprobs(lg3, targets, top_k=2, top_p=0.6, return_support=True)
    assert s.tolist() == [[True, False, False]]
    assert got[0, 0].item() == 0.0


def test_support_is_monotone_and_renormalized():
    logits = make_logits("ties", (4, 6, 20), torch.float64, seed=11)
    V = logits.shape[-1]

    def support(**kw):
        return sampling_logits(logits, **kw) > -INF

    for k in range(1, V):
        assert bool((support(top_k=k) <= support(top_k=k + 1)).all())
        assert bool((support(top_k=k).sum(-1) >= k).all())  # ties can only add tokens
    ps = [0.05, 0.2, 0.5, 0.8, 0.95, 1.0]
    for p_small, p_big in zip(ps, ps[1:]):
        assert bool((support(top_p=p_small) <= support(top_p=p_big)).all())
    # probabilities of all V targets sum to one under every setting
    rows = logits.reshape(-1, 1, V).expand(-1, V, V)
    all_targets = torch.arange(V).expand(rows.shape[0], V)
    for kw in [dict(), dict(top_k=3), dict(top_p=0.4, temperature=0.5), dict(top_k=6, top_p=0.9)]:
        total = token_logprobs(rows, all_targets, **kw).exp().sum(-1)
        torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-12)


def test_sampled_tokens_are_always_in_support():
    logits = make_logits("randn", (8, 5, 40), torch.float32, seed=5)
    kw = dict(temperature=0.9, top_k=10, top_p=0.7)
    q = sampling_logits(logits, **kw).softmax(-1)
    g = torch.Generator().manual_seed(0)
    sampled = torch.multinomial(q.reshape(-1, 40), 1, generator=g).reshape(8, 5)
    logp, in_support = token_logprobs(logits, sampled, return_support=True, **kw)
    assert bool(in_support.all()) and bool(torch.isfinite(logp).all())


# --------------------------------------------------------------------------- §24 ratio one, §7 denominator


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7), dict(top_k=5, top_p=0.8, temperature=1.2)])
def test_current_equals_old_gives_ratio_exactly_one(kw):
    logits = make_logits("randn", (3, 6, 30), torch.float32, seed=2).requires_grad_(True)
    q = sampling_logits(logits.detach(), **kw).softmax(-1)
    targets = torch.multinomial(q.reshape(-1, 30), 1, generator=torch.Generator().manual_seed(1)).reshape(3, 6)
    mask = torch.ones(3, 6)
    mask[0, :2] = 0
    old = token_logprobs(logits.detach(), targets, **kw)
    cur = token_logprobs(logits, targets, **kw)
    ratio = token_log_ratio(cur, old, mask).exp()
    assert torch.equal(ratio, torch.ones_like(ratio))
    # the sampler sees one [B, V] step at a time; the learner sees [B, L, V] at once
    for j in range(6):
        step = token_logprobs(logits.detach()[:, j], targets[:, j], **kw)
        torch.testing.assert_close(step, old[:, j], rtol=0, atol=2e-6)


def test_unmasked_denominator_is_wrong_under_top_p():
    # §7: behaviour log-probs taken from the untruncated softmax while sampling used top-p
    # give a ratio != 1 although the parameters did not change: q_top_p(y) > softmax(y)
    # whenever some mass was truncated.
    logits = make_logits("randn", (2, 4, 30), torch.float64, seed=9)
    q = sampling_logits(logits, top_p=0.5).softmax(-1)
    y = q.argmax(-1)
    wrong_old = token_logprobs(logits, y)
    cur = token_logprobs(logits, y, top_p=0.5)
    assert bool((cur - wrong_old > 0).all())


# --------------------------------------------------------------------------- gradients


def test_gradcheck_no_truncation():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 6, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, y), (z,))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, y, temperature=0.7), (z,))
    assert torch.autograd.gradcheck(lambda x: entropy(x, temperature=1.3), (z,))


def _separated_logits(seed: int, B=2, L=3, V=6) -> torch.Tensor:
    """Rows are permutations of 0..V-1 (spacing 1) plus noise << 1: the top-k/top-p
    support cannot change under gradcheck's perturbations (checked below)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.stack([torch.randperm(V, generator=g) for _ in range(B * L)]).reshape(B, L, V)
    return base.to(torch.float64) + 0.01 * torch.randn(B, L, V, dtype=torch.float64, generator=g)


def test_gradcheck_with_truncation_on_a_stable_support():
    # rows ~ 0..5: after top_k = 4 the kept probs are ∝ e^2..e^5 ≈ [.032, .087, .237, .644],
    # ascending cumulative [.032, .119, .356, 1]; top_p = 0.8 drops mass <= 0.2: the two
    # smallest. Every cumulative value is >= 0.08 away from 0.2.
    z = _separated_logits(0).requires_grad_(True)
    kw = dict(top_k=4, top_p=0.8, temperature=1.0)
    keep = sampling_logits(z.detach(), **kw) > -INF
    assert bool((keep.sum(-1) == 2).all())
    for sign in (-1.0, 1.0):
        bumped = sampling_logits(z.detach() + sign * 1e-3 * torch.randn_like(z), **kw) > -INF
        assert torch.equal(bumped, keep)
    y = z.detach().argmax(-1)  # in the support
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, y, **kw), (z,))
    assert torch.autograd.gradcheck(lambda x: entropy(x, **kw), (z,))


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(top_k=4, top_p=0.8, temperature=1.5)])
def test_gradient_matches_analytic_formula(kw):
    # d logq(y) / d z_v = (1[v = y] - q_v 1[v in S]) / T
    z = _separated_logits(1).requires_grad_(True)
    y = z.detach().argmax(-1)
    token_logprobs(z, y, **kw).sum().backward()
    T = kw["temperature"]
    q = sampling_logits(z.detach(), **kw).softmax(-1)  # exactly 0 outside S
    onehot = torch.nn.functional.one_hot(y, z.shape[-1]).to(z.dtype)
    torch.testing.assert_close(z.grad, (onehot - q) / T, rtol=0, atol=1e-14)


def test_entropy_gradient_matches_analytic_formula():
    # H = -sum_v q_v log q_v  =>  dH/dz_v = -q_v (log q_v + H) / T on S, 0 outside
    z = _separated_logits(2).requires_grad_(True)
    kw = dict(temperature=0.8, top_k=5)
    H = entropy(z, **kw)
    H.sum().backward()
    w = sampling_logits(z.detach(), **kw)
    q = w.softmax(-1)
    logq = torch.where(w > -INF, w.log_softmax(-1), torch.zeros_like(w))
    expected = -q * (logq + H.detach()[..., None]) / kw["temperature"]
    torch.testing.assert_close(z.grad, expected, rtol=0, atol=1e-14)


def test_target_outside_support_has_finite_gradient():
    z = _separated_logits(3).requires_grad_(True)
    y = z.detach().argmin(-1)  # never in the top-2 support
    logp, in_support = token_logprobs(z, y, top_k=2, return_support=True)
    assert not bool(in_support.any()) and bool((logp == -INF).all())
    logp.sum().backward()
    assert bool(torch.isfinite(z.grad).all())
    z.grad = None
    token_logprobs(z, y, top_k=2, top_p=0.9).exp().sum().backward()
    assert bool(torch.isfinite(z.grad).all())


# --------------------------------------------------------------------------- entropy


def test_entropy_hand_values():
    third = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64).log().expand(1, 1, 3)
    assert entropy(third).item() == pytest.approx(1.5 * math.log(2.0), abs=1e-14)
    assert entropy(third, top_k=1).item() == 0.0
    # top_k = 2 with a tie at the 2nd place keeps all three tokens
    assert entropy(third, top_k=2).item() == pytest.approx(1.5 * math.log(2.0), abs=1e-14)
    # T = 2: q ∝ [2^-1/2, 1/2, 1/2]
    a = 2 ** -0.5
    s = a + 1.0
    q = [a / s, 0.5 / s, 0.5 / s]
    assert entropy(third, temperature=2.0).item() == pytest.approx(-sum(x * math.log(x) for x in q), abs=1e-14)
    # [0.5, 0.3, 0.2] with top_p = 0.6 keeps {0, 1}: [0.625, 0.375]
    p532 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log().expand(1, 1, 3)
    h = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))
    assert entropy(p532, top_p=0.6).item() == pytest.approx(h, abs=1e-14)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, 0.8), (1.0, None, 0.3)])
def test_entropy_matches_hf_distribution(temperature, top_k, top_p):
    logits = make_logits("randn", (3, 4, 50), torch.float64, seed=4)
    ref = hf_warp(logits, temperature, top_k, top_p)
    q = ref.softmax(-1)
    expected = -(q * ref.log_softmax(-1)).nan_to_num(0.0, posinf=0.0, neginf=0.0).sum(-1)
    got = entropy(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- masked slots


@pytest.mark.parametrize("checked", [True, False])
def test_nan_and_bad_ids_in_masked_slots_change_nothing(checked):
    B, L, V = 3, 5, 12
    clean = make_logits("randn", (B, L, V), torch.float64, seed=6)
    targets = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, L)
    mask[0, 0] = mask[1, 3:] = mask[2, 1] = 0
    dirty = clean.clone()
    dirty[0, 0] = math.nan
    dirty[1, 3, 2] = INF
    dirty[1, 4] = -INF
    dirty[2, 1, 0] = math.nan
    dirty_targets = targets.clone()
    dirty_targets[0, 0] = -100
    dirty_targets[1, 4] = V + 3

    def run(logits, tg):
        z = logits.clone().requires_grad_(True)
        with trajgrad.validation(checked):
            logp, s = token_logprobs(z, tg, top_k=6, top_p=0.9, mask=mask, return_support=True)
            h = entropy(z, temperature=0.8, mask=mask)
        loss = (torch.where(s, logp, torch.zeros_like(logp)) + h).sum()
        loss.backward()
        return logp.detach(), s, h.detach(), z.grad

    ref = run(clean, targets)
    got = run(dirty, dirty_targets)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert bool(torch.isfinite(got[3]).all())
    valid = mask.bool()
    assert bool((got[0][~valid] == 0).all()) and bool(got[1][~valid].all())
    assert bool((got[2][~valid] == 0).all())
    assert bool((got[3][~valid] == 0).all())  # masked rows get no gradient


# --------------------------------------------------------------------------- bad input


def test_bad_parameters_raise_naming_the_argument():
    z = torch.zeros(2, 3, 5)
    y = torch.zeros(2, 3, dtype=torch.long)
    for fn in (
        lambda **kw: token_logprobs(z, y, **kw),
        lambda **kw: entropy(z, **kw),
        lambda **kw: sampling_logits(z, **kw),
    ):
        for t in (0.0, -1.0, math.nan, math.inf, "hot", True):
            with pytest.raises(ValueError, match="temperature"):
                fn(temperature=t)
        for k in (0, -2, 2.5, True, "3"):
            with pytest.raises(ValueError, match="top_k"):
                fn(top_k=k)
        for p in (0.0, -0.1, 1.5, math.nan, "0.5"):
            with pytest.raises(ValueError, match="top_p"):
                fn(top_p=p)


def test_bad_tensors_raise_naming_the_argument():
    z = torch.zeros(2, 3, 5)
    y = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(z, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(z, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(z, y.float())
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(z, y.bool())
    for bad in (5, -1):
        yb = y.clone()
        yb[1, 2] = bad
        with pytest.raises(ValueError, match="targets"):
            token_logprobs(z, yb)
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(torch.zeros(5), torch.zeros((), dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(torch.zeros(2, 3, 5, dtype=torch.long), y)
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(torch.zeros(2, 3, 0), y)
    with pytest.raises(ValueError, match="mask"):
        token_logprobs(z, y, mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="mask"):
        token_logprobs(z, y, mask=torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="mask"):
        entropy(z, mask=torch.ones(3, 2))
    for poison in (math.nan, INF):
        zb = z.clone()
        zb[0, 1, 2] = poison
        with pytest.raises(ValueError, match="logits"):
            token_logprobs(zb, y)
        with pytest.raises(ValueError, match="logits"):
            entropy(zb)
        with pytest.raises(ValueError, match="logits"):
            sampling_logits(zb)
    all_neg_inf = z.clone()
    all_neg_inf[1, 0] = -INF
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(all_neg_inf, y)
    # a masked position may hold the poison
    out = token_logprobs(all_neg_inf, y, mask=torch.tensor([[1, 1, 1], [0, 1, 1]]))
    assert bool(torch.isfinite(out).all())


def test_empty_sequence_dimension():
    out, s = token_logprobs(torch.zeros(2, 0, 5), torch.zeros(2, 0, dtype=torch.long), top_p=0.5, return_support=True)
    assert out.shape == (2, 0) and s.shape == (2, 0)
    assert entropy(torch.zeros(2, 0, 5), top_k=2).shape == (2, 0)


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError):
        getattr(lp_mod, "no_such_name")
