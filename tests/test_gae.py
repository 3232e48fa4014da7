"""Property tests for trajgrad.advantages.td against per-step loops (spec §6, §20.4).

Every case draws random masks, terminations, truncations and bootstrap values, stores
garbage (NaN, ±inf, or huge finite numbers) wherever the documented rules say an input is
not read, and compares with a plain Python loop over time on the clean inputs, to 1e-10 in
float64.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trajgrad.advantages.td as gae_module
import trajgrad.advantages.returns as returns_module
from trajgrad import _checks
from trajgrad.advantages.returns import GAEOutput, gae, skip_observation_gae, token_skip_observation_gae

F64 = torch.float64
NAN, INF = float("nan"), float("inf")
SETTINGS = settings(max_examples=80, deadline=None)
GARBAGE = st.sampled_from(["nan", "inf", "huge", "finite"])


def loop_gae(r, v, gamma, lam, mask, term, trunc, tv, boot):
    """Per-step loop over time (right to left) carrying the next value and advantage across mask-0 steps."""
    bsz, length = r.shape
    adv = torch.zeros(bsz, length, dtype=F64)
    for b in range(bsz):
        next_value = 0.0 if boot is None else float(boot[b])
        next_adv = 0.0
        for t in reversed(range(length)):
            if not mask[b, t]:
                continue
            if term is not None and term[b, t]:
                nxt, carry = 0.0, 0.0
            elif trunc is not None and trunc[b, t]:
                nxt, carry = float(tv[b, t]), 0.0
            else:
                nxt, carry = next_value, 1.0
            a = float(r[b, t]) + gamma * nxt - float(v[b, t]) + gamma * lam * carry * next_adv
            adv[b, t] = a
            next_value, next_adv = float(v[b, t]), a
    return adv


def garbage_like(x, kind, gen):
    if kind == "nan":
        return torch.full_like(x, NAN)
    if kind == "inf":
        signs = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0).to(x.dtype)
        return signs * INF
    if kind == "huge":
        signs = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0).to(x.dtype)
        return signs * 1.5e308
    return 1e6 * torch.randn(x.shape, generator=gen, dtype=x.dtype)


def draw(seed, b_, t_, p_pad, p_term, p_trunc, right=False):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(b_, t_, generator=gen, dtype=F64)
    v = torch.randn(b_, t_, generator=gen, dtype=F64)
    mask = torch.rand(b_, t_, generator=gen) >= p_pad
    if right:  # right padding: each row valid up to a random length (0 to T)
        lengths = torch.randint(0, t_ + 1, (b_,), generator=gen)
        mask = torch.arange(t_)[None, :] < lengths[:, None]
    term = (torch.rand(b_, t_, generator=gen) < p_term) & mask
    trunc = (torch.rand(b_, t_, generator=gen) < p_trunc) & mask
    tv = torch.randn(b_, t_, generator=gen, dtype=F64)
    boot = torch.randn(b_, generator=gen, dtype=F64)
    return gen, r, v, mask, term, trunc, tv, boot


def last_valid_carries(mask, term, trunc):
    """[B] bool: the row's last valid step reads the bootstrap value."""
    out = torch.zeros(mask.shape[0], dtype=torch.bool)
    for b in range(mask.shape[0]):
        idx = torch.nonzero(mask[b]).flatten()
        if len(idx):
            t = int(idx[-1])
            out[b] = not ((term is not None and term[b, t]) or (trunc is not None and trunc[b, t]))
    return out


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), b_=st.integers(1, 4), t_=st.integers(0, 48),
       gamma=st.floats(0, 1), lam=st.floats(0, 1), p_pad=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
       p_term=st.sampled_from([0.0, 0.1, 0.4]), p_trunc=st.sampled_from([0.0, 0.1, 0.4]),
       use_mask=st.booleans(), use_term=st.booleans(), use_trunc=st.booleans(), use_boot=st.booleans(),
       garbage=GARBAGE, float_flags=st.booleans(), right=st.booleans())
def test_gae_matches_loop_with_garbage_where_not_read(seed, b_, t_, gamma, lam, p_pad, p_term, p_trunc, use_mask,
                                                      use_term, use_trunc, use_boot, garbage, float_flags, right):
    gen, r, v, mask, term, trunc, tv, boot = draw(seed, b_, t_, p_pad if use_mask else 0.0, p_term, p_trunc,
                                                  right=right and use_mask)
    term_ = term if use_term else None
    trunc_ = trunc & ~term if (use_trunc and use_term) else (trunc if use_trunc else None)
    expected = loop_gae(r, v, gamma, lam, mask, term_, trunc_, tv, boot if use_boot else None)

    # garbage wherever an input is documented as not read
    r2 = torch.where(mask, r, garbage_like(r, garbage, gen))
    v2 = torch.where(mask, v, garbage_like(v, garbage, gen))
    kwargs = {}
    if use_mask:
        kwargs["mask"] = mask.to(F64) if float_flags else mask
    if use_term:
        kwargs["terminated"] = term.to(F64) if float_flags else term
    if use_trunc:
        kwargs["truncated"] = trunc.to(F64) if float_flags else trunc
        read = trunc_ & mask
        kwargs["truncation_value"] = torch.where(read, tv, garbage_like(tv, garbage, gen))
    if use_boot:
        reads = last_valid_carries(mask, term_, trunc_)
        kwargs["bootstrap_value"] = torch.where(reads, boot, garbage_like(boot, garbage, gen))
    out = gae(r2, v2, gamma=gamma, lam=lam, **kwargs)
    assert isinstance(out, GAEOutput)
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.returns, torch.where(mask, expected + v, torch.zeros_like(v)), rtol=0, atol=1e-10)
    assert torch.all(out.advantages[~mask] == 0) and torch.all(out.returns[~mask] == 0)
    # the same call without value checks gives the same numbers (selection does not depend on them)
    with _checks.validation(False):
        again = gae(r2, v2, gamma=gamma, lam=lam, **kwargs)
    assert torch.equal(again.advantages, out.advantages) and torch.equal(again.returns, out.returns)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n_actions=st.integers(1, 10), gamma=st.floats(0, 1), lam=st.floats(0, 1),
       garbage=GARBAGE, flags=st.booleans())
def test_token_level_matches_loop_on_transcripts(seed, n_actions, gamma, lam, garbage, flags):
    gen = torch.Generator().manual_seed(seed)
    b_ = 3
    pieces = []
    for _ in range(b_):
        row = [False] * int(torch.randint(0, 4, (1,), generator=gen))  # prompt
        for _ in range(n_actions):
            row += [True] * int(torch.randint(1, 6, (1,), generator=gen))
            row += [False] * int(torch.randint(0, 5, (1,), generator=gen))  # observation
        pieces.append(row)
    width = max(len(p) for p in pieces)
    mask = torch.tensor([p + [False] * (width - len(p)) for p in pieces])
    v = torch.randn(b_, width, generator=gen, dtype=F64)
    r = torch.where(mask, torch.randn(b_, width, generator=gen, dtype=F64), torch.zeros(b_, width, dtype=F64))
    term = (torch.rand(b_, width, generator=gen) < 0.1) & mask if flags else None
    trunc = (torch.rand(b_, width, generator=gen) < 0.1) & mask & ~term if flags else None
    tv = torch.randn(b_, width, generator=gen, dtype=F64)
    boot = torch.randn(b_, generator=gen, dtype=F64)
    expected = loop_gae(r, v, gamma, lam, mask, term, trunc, tv, boot)
    kwargs = dict(bootstrap_value=boot)
    if flags:
        kwargs.update(terminated=term, truncated=trunc,
                      truncation_value=torch.where(trunc, tv, torch.full_like(tv, NAN)))
    out = token_skip_observation_gae(torch.where(mask, v, garbage_like(v, garbage, gen)),
                                     torch.where(mask, r, garbage_like(r, garbage, gen)), mask,
                                     gamma=gamma, lam=lam, **kwargs)
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-10)
    # bridging: the result equals plain GAE on the compacted action tokens of each row
    for b in range(b_):
        keep = mask[b]
        compact = gae(r[b, keep][None], v[b, keep][None], gamma=gamma, lam=lam, bootstrap_value=boot[b:b + 1],
                      **({} if not flags else dict(terminated=term[b, keep][None], truncated=trunc[b, keep][None],
                                                   truncation_value=tv[b, keep][None])))
        torch.testing.assert_close(out.advantages[b, keep], compact.advantages[0], rtol=0, atol=1e-10)


def loop_per_action(end_v, next_v, rew, terms, mask, gamma, lam):
    out = torch.zeros_like(rew)
    for b in range(rew.shape[0]):
        nxt = 0.0
        for i in reversed(range(rew.shape[1])):
            if not mask[b, i]:
                continue
            cont = 0.0 if terms[b, i] else 1.0
            nv = float(next_v[b, i]) if cont else 0.0
            nxt = float(rew[b, i]) + gamma * nv - float(end_v[b, i]) + gamma * lam * cont * nxt
            out[b, i] = nxt
    return out


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), b_=st.integers(1, 3), n=st.integers(1, 40), gamma=st.floats(0, 1),
       lam=st.floats(0, 1), p_pad=st.sampled_from([0.0, 0.3, 1.0]), garbage=GARBAGE, use_mask=st.booleans())
def test_per_action_matches_listing_with_garbage(seed, b_, n, gamma, lam, p_pad, garbage, use_mask):
    gen = torch.Generator().manual_seed(seed)
    end_v, next_v, rew = (torch.randn(b_, n, generator=gen, dtype=F64) for _ in range(3))
    mask = torch.rand(b_, n, generator=gen) >= (p_pad if use_mask else 0.0)
    terms = torch.rand(b_, n, generator=gen) < 0.25
    expected = loop_per_action(end_v, next_v, rew, terms, mask, gamma, lam)
    g = lambda x: garbage_like(x, garbage, gen)  # noqa: E731
    dirty_end = torch.where(mask, end_v, g(end_v))
    dirty_rew = torch.where(mask, rew, g(rew))
    dirty_next = torch.where(mask & ~terms, next_v, g(next_v))  # not read at terminals either
    out = skip_observation_gae(dirty_end, dirty_next, dirty_rew, terms.to(F64), gamma, lam,
                               mask=mask if use_mask else None)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    assert torch.all(out[~mask] == 0)


def test_long_row_with_flags_and_padding_matches_loop():
    """One 131,072-step row with padding spans, terminations and truncations (no under/overflow)."""
    gen = torch.Generator().manual_seed(11)
    n = 131_072
    r = torch.randn(1, n, generator=gen, dtype=F64)
    v = torch.randn(1, n, generator=gen, dtype=F64)
    mask = (torch.arange(n) // 300 % 4 != 3)[None]
    term = (torch.rand(1, n, generator=gen) < 1e-3) & mask
    trunc = (torch.rand(1, n, generator=gen) < 1e-3) & mask & ~term
    tv = torch.randn(1, n, generator=gen, dtype=F64)
    gamma, lam = 1.0, 0.999
    out = gae(torch.where(mask, r, torch.full_like(r, NAN)), v, gamma=gamma, lam=lam, mask=mask, terminated=term,
              truncated=trunc, truncation_value=tv, bootstrap_value=2.0)
    rl, vl, ml, tl, ul, tvl = (x[0].tolist() for x in (r, v, mask, term, trunc, tv))
    adv = [0.0] * n
    nxt_v, nxt_a = 2.0, 0.0
    for i in range(n - 1, -1, -1):
        if not ml[i]:
            continue
        if tl[i]:
            nv, c = 0.0, 0.0
        elif ul[i]:
            nv, c = tvl[i], 0.0
        else:
            nv, c = nxt_v, 1.0
        nxt_a = rl[i] + gamma * nv - vl[i] + gamma * lam * c * nxt_a
        nxt_v = vl[i]
        adv[i] = nxt_a
    torch.testing.assert_close(out.advantages[0], torch.tensor(adv, dtype=F64), rtol=0, atol=1e-10)


def test_float32_and_mixed_dtypes():
    gen = torch.Generator().manual_seed(2)
    r = torch.randn(2, 33, generator=gen)
    v = torch.randn(2, 33, generator=gen, dtype=F64)
    mask = torch.rand(2, 33, generator=gen) > 0.3
    out32 = gae(r, v.float(), gamma=0.99, lam=0.95, mask=mask)
    assert out32.advantages.dtype == torch.float32
    out = gae(r, v, gamma=0.99, lam=0.95, mask=mask)
    assert out.advantages.dtype == F64
    torch.testing.assert_close(out32.advantages.double(), out.advantages, rtol=0, atol=1e-4)


def test_outputs_carry_no_gradient_and_inputs_get_none():
    r = torch.randn(2, 9, dtype=F64, requires_grad=True)
    v = torch.randn(2, 9, dtype=F64, requires_grad=True)
    mask = torch.rand(2, 9) > 0.3
    outs = [*gae(r, v, gamma=0.9, lam=0.9, mask=mask, terminated=mask & (r > 1)),
            *token_skip_observation_gae(v, r, mask, gamma=0.9, lam=0.9),
            skip_observation_gae(v, v, r, torch.zeros(2, 9), 0.9, 0.9, mask=mask)]
    for x in outs:
        assert not x.requires_grad and x.grad_fn is None
    assert r.grad is None and v.grad is None


def test_public_names_import_from_returns():
    for name in ["GAEOutput", "gae", "token_skip_observation_gae", "skip_observation_gae", "discounted_return",
                 "reward_to_go", "n_step_advantage", "shape_rewards"]:
        assert name in returns_module.__all__
        assert callable(getattr(returns_module, name))
    for name in gae_module.__all__:
        assert getattr(returns_module, name) is getattr(gae_module, name)


@pytest.mark.parametrize("bad", [NAN, INF])
def test_non_finite_at_valid_steps_still_raise(bad):
    r = torch.zeros(2, 5, dtype=F64)
    v = torch.zeros(2, 5, dtype=F64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 4] = False
    r[0, 4] = bad  # padding: fine
    gae(r, v, gamma=0.9, lam=0.9, mask=mask)
    r[1, 2] = bad  # valid: error naming the argument
    with pytest.raises(ValueError, match="rewards"):
        gae(r, v, gamma=0.9, lam=0.9, mask=mask)
    v[0, 0] = bad
    with pytest.raises(ValueError, match="values"):
        gae(torch.zeros(2, 5), v, gamma=0.9, lam=0.9, mask=mask)
    with pytest.raises(ValueError, match="bootstrap_value"):
        gae(torch.zeros(2, 5), torch.zeros(2, 5), gamma=0.9, lam=0.9, mask=mask, bootstrap_value=torch.tensor([0, bad]))
    with pytest.raises(ValueError, match="next_action_values"):
        skip_observation_gae(torch.zeros(2, 5), v, torch.zeros(2, 5), torch.zeros(2, 5), 0.9, 0.9)


@pytest.mark.parametrize("lam", [1.0, 0.95, 0.5, 0.3, 0.0])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("layout", ["observations", "right_padding", "none"])
def test_one_finiteness_reduction_still_names_each_input(lam, bad, layout):
    """The offset's single reduction stands in for one per input: every non-finite valid input,
    at every lam (lam = 1, where values leave the offset, included) still raises naming itself,
    and garbage where an input is not read still passes."""
    t_ = 9
    mask = {"observations": torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1, 1, 0, 1]], dtype=torch.bool),
            "right_padding": torch.arange(t_)[None, :] < torch.tensor([[7], [9]]),
            "none": None}[layout]
    valid = torch.ones(2, t_, dtype=torch.bool) if mask is None else mask
    trunc = torch.zeros(2, t_, dtype=torch.bool)
    trunc[1, 5] = True
    gen = torch.Generator().manual_seed(3)
    r, v, tv = (torch.randn(2, t_, generator=gen, dtype=F64) for _ in range(3))
    kw = dict(gamma=0.9, lam=lam, mask=mask, truncated=trunc)
    tv_ok = torch.where(trunc, tv, torch.full_like(tv, bad))  # not read where not truncated
    pad = lambda x: torch.where(valid, x, torch.full_like(x, bad))  # noqa: E731
    expected = loop_gae(r, v, 0.9, lam, valid, None, trunc, tv, None)
    out = gae(pad(r), pad(v), truncation_value=tv_ok, **kw)
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-10)
    where = (1, 6)
    for name in ["rewards", "values", "truncation_value"]:
        x = {"rewards": r, "values": v, "truncation_value": tv}[name].clone()
        x[where if name != "truncation_value" else (1, 5)] = bad
        args = {"rewards": r, "values": v, "truncation_value": tv, name: x}
        with pytest.raises(ValueError, match=name):
            gae(args["rewards"], args["values"], truncation_value=args["truncation_value"], **kw)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16, torch.bfloat16])
def test_bitwise_selection_is_exact_selection(dtype):
    from trajgrad.advantages._steps import Padding

    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(3, 50, generator=gen) > 0.4
    x = torch.randn(3, 50, generator=gen).to(dtype)
    x[~mask] = torch.tensor([NAN, INF, -INF, -0.0, 7.0], dtype=dtype).repeat(50)[: int((~mask).sum())]
    expected = torch.where(mask, x, torch.zeros((), dtype=dtype))
    pad = Padding(mask, dtype)
    assert torch.equal(pad.zero_(x.clone()), expected)
    out = torch.empty_like(x)
    carry = mask & (torch.rand(3, 50, generator=gen) > 0.3)
    rate = torch.tensor(0.9 * 0.95, dtype=dtype).item()
    k = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    want = torch.where(mask, torch.where(carry, k(rate), k(0.0)), k(1.0))
    assert torch.equal(pad.coefficients_(out, carry, rate), want)
    assert torch.equal(pad.coefficients_(out, carry, rate, scratch=torch.full_like(x, NAN)), want)
    assert torch.equal(pad.zero_(x.clone()), expected)
    want_all = torch.where(mask, k(rate), k(1.0))
    assert torch.equal(pad.coefficients_(out, None, rate), want_all)
    assert torch.equal(pad.coefficients_(out, None, rate, scratch=torch.empty_like(x)), want_all)


def test_many_right_padded_rows_and_low_precision_with_garbage():
    """More rows than the per-row tail fill handles (bitwise path), and float32 inputs."""
    gen = torch.Generator().manual_seed(9)
    b_, t_ = 70, 41
    r = torch.randn(b_, t_, generator=gen, dtype=F64)
    v = torch.randn(b_, t_, generator=gen, dtype=F64)
    lengths = torch.randint(0, t_ + 1, (b_,), generator=gen)
    mask = torch.arange(t_)[None, :] < lengths[:, None]
    term = (torch.rand(b_, t_, generator=gen) < 0.1) & mask
    boot = torch.randn(b_, generator=gen, dtype=F64)
    expected = loop_gae(r, v, 0.97, 0.9, mask, term, None, None, boot)
    reads = last_valid_carries(mask, term, None)
    out = gae(torch.where(mask, r, NAN), torch.where(mask, v, INF), gamma=0.97, lam=0.9, mask=mask, terminated=term,
              bootstrap_value=torch.where(reads, boot, NAN))
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-10)
    out2 = gae(torch.where(mask, r, NAN), v, gamma=0.97, lam=0.9, mask=mask, bootstrap_value=boot)
    torch.testing.assert_close(out2.advantages, loop_gae(r, v, 0.97, 0.9, mask, None, None, None, boot),
                               rtol=0, atol=1e-10)
    out32 = gae(torch.where(mask, r, NAN).float(), v.float(), gamma=0.97, lam=0.9, mask=mask, terminated=term,
                bootstrap_value=boot.float())
    assert out32.advantages.dtype == torch.float32 and torch.isfinite(out32.advantages).all()
    torch.testing.assert_close(out32.advantages.double(), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_select_is_where(dtype):
    from trajgrad.advantages._steps import select

    gen = torch.Generator().manual_seed(6)
    where = torch.rand(4, 33, generator=gen) > 0.5
    x = torch.randn(4, 33, generator=gen).to(dtype)
    x[~where] = NAN
    x[0, ~where[0]] = -INF
    out = select(x.t().contiguous().t(), where)  # any layout
    assert out.dtype == dtype
    assert torch.equal(out, torch.where(where, x, torch.zeros((), dtype=dtype)))
    buf = torch.full_like(x, 5.0)
    assert select(x, where, out=buf).data_ptr() == buf.data_ptr()
    assert torch.equal(buf, out)


@pytest.mark.parametrize("lam", [0.5, 0.9, 1.0])
def test_huge_finite_bootstrap_that_is_not_read_does_not_overflow_into_the_row(lam):
    """A finite bootstrap near the float64 maximum, stored where it is not read (the row's last
    valid step is truncated and padding follows it): the scan divides the offset by lam, and
    the unread value must not overflow to inf and reach the valid steps as 0 * inf = NaN."""
    r = torch.tensor([[1.0, -0.5, 2.0, 0.0]], dtype=F64)
    v = torch.tensor([[0.3, 0.1, -0.2, 0.0]], dtype=F64)
    mask = torch.tensor([[True, False, True, False]])  # padding inside and after: not right padded
    trunc = torch.tensor([[False, False, True, False]])
    tv = torch.tensor([[0.0, 0.0, 0.7, 0.0]], dtype=F64)
    for gamma in (0.0, 0.9):
        ref = gae(r, v, gamma=gamma, lam=lam, mask=mask, truncated=trunc, truncation_value=tv)
        out = gae(r, v, gamma=gamma, lam=lam, mask=mask, truncated=trunc, truncation_value=tv,
                  bootstrap_value=torch.tensor([1.5e308], dtype=F64))
        assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns).all()
        torch.testing.assert_close(out.advantages, ref.advantages, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.returns, ref.returns, rtol=0, atol=1e-12)
