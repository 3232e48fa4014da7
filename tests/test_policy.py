"""The learner's forward pass: a shared prompt prefix computed once is the same function,
with the same gradient, as the plain per-row pass."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from trajgrad.model.kv import cache_kwarg, output_cache
from trajgrad.model.learner import causal_parts, head_inputs, learner_logprobs
from trajgrad.model.positions import position_ids_from_attention_mask, prefix_groups
from trajgrad.model.tiny import build_tiny_model
from trajgrad.model.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _batch(B=4, T=40, P=20, seed=0, groups=1):
    """Rows share their first ``P`` tokens (``groups=2``: rows 0-1 and rows 2-3 share a
    prefix of ``P`` and ``P + 4`` tokens, and all rows their first 6; ``"interleaved"``: the
    same rows in the order 0, 2, 1, 3, so that the groups are not consecutive blocks)."""
    if groups == "interleaved":
        order = [0, 2, 1, 3]
        ids, am, act = _batch(B, T, P, seed, groups=2)
        return ids[order], am[order], act[order]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 90, (B, T), generator=g)
    if groups == 1:
        ids[:, :P] = ids[0, :P]
    else:
        half = B // 2
        ids[:half, :P] = ids[0, :P]
        ids[half:, :P + 4] = ids[half, :P + 4]
        ids[:, :6] = ids[0, :6]
        ids[half:, 6] = ids[0, 6] + 1  # the two groups differ from token 6 on
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 30:] = 0  # ragged right padding
    am[2, 25:] = 0
    ids[am == 0] = 0
    act = am[:, 1:].clone()
    act[:, : P - 1] = 0  # the prompt is not trained; target P-1 is the first action token
    return ids, am, act


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    out = fn()
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel(a, b):
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


def _brute_force_single(ids, am, min_prefix):
    """The most token positions one prefix length for every row saves."""
    B = ids.shape[0]
    cap = min(int(am.sum(1).min()) - 1, int(am.long().cumprod(1).sum(1).min()))
    best = 0
    for p in range(max(min_prefix, 1), cap + 1):
        distinct = len({tuple(r[:p].tolist()) for r in ids})
        best = max(best, (B - distinct) * p)
    return best


def _brute_force_saving(ids, am, min_prefix):
    """The most token positions any threshold p saves, each group sharing what all its rows share."""
    B = ids.shape[0]
    cap = [min(int(am[b].sum()) - 1, int(am[b].cumprod(0).sum())) for b in range(B)]
    rows = [ids[b, : int(am[b].cumprod(0).sum())].tolist() for b in range(B)]

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    best = 0
    for p in range(max(min_prefix, 1), ids.shape[1] + 1):
        groups = {}
        for b in range(B):
            groups.setdefault(tuple(rows[b][:p]) if cap[b] >= p else ("alone", b), []).append(b)
        saved = 0
        for members in groups.values():
            if len(members) > 1:
                share = min(min(cap[b] for b in members), min(common(rows[members[0]], rows[b]) for b in members))
                saved += (len(members) - 1) * share
        best = max(best, saved)
    return best


def test_prefix_groups_examples():
    ids, am, _ = _batch(P=20)
    g = prefix_groups(ids, am)
    assert g.length >= 20 and g.rows.tolist() == [0] and g.index.tolist() == [0, 0, 0, 0]
    assert prefix_groups(ids[:1], am[:1]) is None  # one row: nothing to share
    ids2 = ids.clone()
    ids2[:, 0] = torch.arange(4)
    assert prefix_groups(ids2, am) is None
    ids, am, _ = _batch(P=20, groups=2)
    g = prefix_groups(ids, am)
    # each group shares what its rows share: rows 2-3 their 24 tokens, within row 2's 25
    assert g.length == 20 and g.index.tolist() == [0, 0, 1, 1] and g.lengths.tolist() == [20, 24]
    assert g.saved_tokens == 44
    # one length for every group (the learner's rectangular prefix pass)
    g = prefix_groups(ids, am, per_group=False)
    assert g.length == 20 and g.index.tolist() == [0, 0, 1, 1] and g.lengths.tolist() == [20, 20]
    assert g.saved_tokens == 40
    with pytest.raises(ValueError, match="input_ids"):
        prefix_groups(ids, am[:, :3])
    with pytest.raises(ValueError, match="per_group"):
        prefix_groups(ids, am, per_group="no")


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 7), st.integers(4, 14), st.integers(1, 4), st.integers(0, 2**16), st.integers(1, 5))
def test_prefix_groups_saves_the_most_and_groups_equal_prefixes(B, T, vocab, seed, min_prefix):
    g_ = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g_)
    lengths = torch.randint(2, T + 1, (B,), generator=g_)
    am = (torch.arange(T)[None] < lengths[:, None]).long()
    g = prefix_groups(ids, am, min_prefix=min_prefix)
    best = _brute_force_saving(ids, am, min_prefix)
    one = prefix_groups(ids, am, min_prefix=min_prefix, per_group=False)  # one length for every group
    single = _brute_force_single(ids, am, min_prefix)
    assert (one is None and single == 0) or (one.saved_tokens == single > 0 and set(one.lengths.tolist()) == {one.length})
    if one is not None:
        assert one.length < int(lengths.min())  # a token left in every row
        for b in range(B):
            assert torch.equal(ids[b, : one.length], ids[one.rows[one.index[b]], : one.length])
    if g is None:
        assert best == 0
        return
    assert g.saved_tokens == best > 0
    sizes = torch.bincount(g.index)
    for b in range(B):
        n = int(g.lengths[g.index[b]])
        assert n < int(lengths[b])  # a token left in every row
        assert torch.equal(ids[b, :n], ids[g.rows[g.index[b]], :n])
        assert sizes[g.index[b]] == 1 or n >= g.length
    shared = [r for u, r in enumerate(g.rows.tolist()) if sizes[u] > 1]
    assert len({tuple(ids[r, : g.length].tolist()) for r in shared}) == len(shared)  # groups are distinct



@pytest.mark.parametrize("groups", [1, 2, "interleaved"], ids=["one-prefix", "two-groups", "two-groups-interleaved"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_forward_and_gradient_equal_the_plain_pass(tok, attn, groups):
    model = build_tiny_model(tok, hidden_size=32, layers=2, heads=2, seed=0, dtype=torch.float64)
    model.set_attn_implementation(attn)
    ids, am, act = _batch(groups=groups)
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss(share):
        h, _, _ = head_inputs(model, ids, am, share_prefix=share)
        return (h * w * act[..., None]).sum()

    v_plain, g_plain = _grads(model, lambda: loss(False))
    v_share, g_share = _grads(model, lambda: loss(True))
    assert torch.allclose(v_share, v_plain, rtol=1e-12, atol=1e-12)
    # Hugging Face computes the attention softmax in float32 (eager) and sdpa's CPU kernels
    # sum in another order, so float64 gradients agree to ~1e-7 relative, not 1e-15
    assert _max_rel(g_share, g_plain) < 1e-5

    # the check can fail: cutting the gradient through the prefix's keys/values is wrong
    backbone, head = causal_parts(model)
    kw = cache_kwarg(backbone)

    def detached_prefix():
        pos = position_ids_from_attention_mask(am)
        g = prefix_groups(ids, am)
        P, idx = g.length, g.index
        with torch.no_grad():
            first = backbone(input_ids=ids[g.rows, :P], attention_mask=am[g.rows, :P], position_ids=pos[g.rows, :P],
                             use_cache=True, **{kw: DynamicCache()})
        cache = output_cache(first)
        for layer in cache.layers:
            layer.keys = layer.keys[idx]
            layer.values = layer.values[idx]
        rest = backbone(input_ids=ids[:, P:], attention_mask=am, position_ids=pos[:, P:], use_cache=True, **{kw: cache})
        h = torch.cat([first.last_hidden_state[idx], rest.last_hidden_state], 1)[:, :-1]
        return (h * w * act[..., None]).sum()

    _, g_wrong = _grads(model, detached_prefix)
    assert _max_rel(g_wrong, g_plain) > 1e-2


@pytest.mark.parametrize("groups", [1, 2, "interleaved"])
def test_learner_logprobs_use_the_prefix_exactly(tok, groups):
    model = build_tiny_model(tok, hidden_size=32, layers=2, heads=2, seed=3, dtype=torch.float64)
    ids, am, act = _batch(seed=4, groups=groups)
    a = learner_logprobs(model, ids, am, act).logp
    # per row, alone (no prefix to share, no padding neighbours)
    rows = [learner_logprobs(model, ids[b:b + 1], am[b:b + 1], act[b:b + 1]).logp for b in range(ids.shape[0])]
    assert torch.allclose(a, torch.cat(rows, 0), rtol=0, atol=1e-12)


def test_dropout_disables_prefix_sharing(tok):
    """With dropout active every row draws its own masks, so the prefix is not shared."""
    model = build_tiny_model(tok, hidden_size=32, layers=1, heads=2, seed=0, dtype=torch.float64)
    model.config.attention_dropout = 0.5
    model.train()
    ids, am, _ = _batch()
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    try:
        head_inputs(model, ids, am)
        model.eval()
        head_inputs(model, ids, am)
    finally:
        handle.remove()
    assert seen[0] == ids.shape  # training with dropout: one plain pass
    assert seen[1][0] == 1 and len(seen) == 3  # eval: the prefix once, then the rest


def test_trailing_padding_columns_are_not_computed(tok):
    model = build_tiny_model(tok, hidden_size=32, layers=1, heads=2, seed=0, dtype=torch.float64)
    ids, am, act = _batch()
    wide_ids = torch.nn.functional.pad(ids, (0, 25))
    wide_am = torch.nn.functional.pad(am, (0, 25))
    wide_act = torch.nn.functional.pad(act, (0, 25))
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-1]))
    try:
        h_wide = head_inputs(model, wide_ids, wide_am)[0]
    finally:
        handle.remove()
    h = head_inputs(model, ids, am)[0]
    assert h_wide.shape[1] == wide_ids.shape[1] - 1 and sum(seen) <= ids.shape[1]
    assert torch.equal(h_wide[:, : h.shape[1]], h) and not h_wide[:, h.shape[1]:].any()
    a = learner_logprobs(model, wide_ids, wide_am, wide_act).logp
    b = learner_logprobs(model, ids, am, act).logp
    assert torch.equal(a[:, : b.shape[1]], b) and not a[:, b.shape[1]:].any()


@pytest.mark.parametrize("index", [[0, 0, 1, 1, 2, 2], [0, 2, 1, 0, 1, 2], [0, 0, 0, 1, 1, 2]],
                         ids=["blocks", "interleaved", "unequal-blocks"])
def test_prefix_spread_equals_index_select_in_value_and_gradient(index):
    """Each group's prefix read by its rows: expanded for equal consecutive blocks, index_select
    otherwise; the same values and the same (summed) gradient either way."""
    from trajgrad.model.learner import _spreader

    idx = torch.tensor(index)
    x = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 2, 5, dtype=torch.float64)
    y = _spreader(idx, 3)(x)
    (g,) = torch.autograd.grad((y * w).sum(), x)
    ref = x.index_select(0, idx)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    assert torch.equal(y, ref)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
