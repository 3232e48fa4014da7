"""The learner's forward pass: a shared prompt prefix computed once is the same function,
with the same gradient, as the plain per-row pass."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from trajgrad.rollout.models import build_char_tokenizer, build_tiny_model, cache_kwarg, output_cache
from trajgrad.train.policy import causal_parts, head_inputs, learner_logprobs, position_ids_from_mask, shared_prefix_length


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _batch(B=4, T=40, P=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 90, (B, T), generator=g)
    ids[:, :P] = ids[0, :P]
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


def test_shared_prefix_length(tok):
    ids, am, _ = _batch(P=20)
    assert shared_prefix_length(ids, am) >= 20
    assert shared_prefix_length(ids[:1], am[:1]) == 0  # one row: nothing to share
    ids2 = ids.clone()
    ids2[3, 0] = ids2[0, 0] + 1
    assert shared_prefix_length(ids2, am) == 0
    same = ids[:1].repeat(3, 1)
    assert shared_prefix_length(same, torch.ones_like(same)) == same.shape[1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_forward_and_gradient_equal_the_plain_pass(tok, attn):
    model = build_tiny_model(tok, hidden_size=32, layers=2, heads=2, seed=0, dtype=torch.float64)
    model.set_attn_implementation(attn)
    ids, am, act = _batch()
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
        pos = position_ids_from_mask(am)
        P = shared_prefix_length(ids, am)
        with torch.no_grad():
            first = backbone(input_ids=ids[:1, :P], attention_mask=am[:1, :P], position_ids=pos[:1, :P], use_cache=True,
                             **{kw: DynamicCache()})
        cache = output_cache(first)
        for layer in cache.layers:
            layer.keys = layer.keys.expand(ids.shape[0], -1, -1, -1)
            layer.values = layer.values.expand(ids.shape[0], -1, -1, -1)
        rest = backbone(input_ids=ids[:, P:], attention_mask=am, position_ids=pos[:, P:], use_cache=True, **{kw: cache})
        h = torch.cat([first.last_hidden_state.expand(ids.shape[0], -1, -1), rest.last_hidden_state], 1)[:, :-1]
        return (h * w * act[..., None]).sum()

    _, g_wrong = _grads(model, detached_prefix)
    assert _max_rel(g_wrong, g_plain) > 1e-2


def test_learner_logprobs_use_the_prefix_exactly(tok):
    model = build_tiny_model(tok, hidden_size=32, layers=2, heads=2, seed=3, dtype=torch.float64)
    ids, am, act = _batch(seed=4)
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
