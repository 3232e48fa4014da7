"""Decode attention over a shared prefix (model/shared_prefix.py) computes what per-row caches compute."""
import pytest
import torch

from trajgrad.model import decode as decode_mod
from trajgrad.model.decode import KVBuffers
from trajgrad.model.kv import RowKV
from trajgrad.model.shared_prefix import SharedPrefix, shared_prefix_attention
from trajgrad.model.tiny import build_tiny_model
from trajgrad.rollout import generation
from trajgrad.rollout.generation import sample_actions

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {
    "mha": lambda tok: build_tiny_model(tok, hidden_size=64, layers=2, heads=4, seed=0, initializer_range=0.2),
    "gqa": lambda tok: build_tiny_model(tok, hidden_size=96, layers=2, heads=6, kv_heads=2, seed=1,
                                        initializer_range=0.2),
}


def _prefixes(model, prompts):
    """One RowKV per prompt (its first len - 1 tokens), from the model's own forward."""
    out = []
    with torch.no_grad():
        for p in prompts:
            res, kv = sample_actions(model, [p[:-1] + [p[-1]]], eos_ids=[1], pad_id=0, temperature=0.0,
                                     max_new_tokens=1, return_kv=True)
            # the cache of the context without its last token: exactly the prompt's first len - 1 tokens
            out.append(RowKV([k[:, :len(p) - 1] for k in kv[0].keys], [v[:, :len(p) - 1] for v in kv[0].values]))
    return out


def _copy(row: RowKV) -> RowKV:
    return RowKV([k.clone() for k in row.keys], [v.clone() for v in row.values])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("sizes", [(4, 4, 4), (3, 1, 4, 2)], ids=["equal", "uneven"])
@pytest.mark.parametrize("after", [1, 2], ids=["last-token", "two-tokens"])
def test_shared_rows_sample_what_per_row_copies_sample(tok, name, sizes, after, monkeypatch):
    """Rows handed the same RowKV object decode with the prefix kept once; rows handed copies
    of it decode with per-row caches. Same generator: the same tokens, log-probs within 1e-5
    (the §24 bound; float32 rounding of other kernels, about 4e-6 at these sharp distributions),
    and the same keys/values handed back for the next turn, also after rows end and are dropped.
    With one token after the prefix (a GRPO group: its prompt but the last token shared) that
    token is a decode step too: no batched copy of the prefixes is built."""
    model = MODELS[name](tok).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 90, (int(n),), generator=g).tolist() for n in (9, 14, 6, 11)[:len(sizes)]]
    heads = _prefixes(model, prompts)
    rows, shared_kv, copied_kv = [], [], []
    for p, h, n in zip(prompts, heads, sizes):
        for j in range(n):
            # the prefix and its last token (after=1), or one more token per row (after=2)
            rows.append(p + [5 + j] * (after - 1))
            shared_kv.append(h)
            copied_kv.append(_copy(h))
    calls = {"shared": 0, "select": 0, "batched": 0}
    real_attn, real_select = decode_mod.shared_prefix_attention, SharedPrefix.select
    real_batched = generation.batched_cache

    def counted_batched(*a, **k):
        calls["batched"] += 1
        return real_batched(*a, **k)

    monkeypatch.setattr(generation, "batched_cache", counted_batched)

    def counted(*a, **k):
        calls["shared"] += 1
        return real_attn(*a, **k)

    def counted_select(self, idx):
        calls["select"] += 1
        return real_select(self, idx)

    monkeypatch.setattr(decode_mod, "shared_prefix_attention", counted)
    monkeypatch.setattr(SharedPrefix, "select", counted_select)
    # a fifth of the vocabulary ends an action: rows end at different steps and ended rows get dropped
    eos = list(range(40, 60))
    out = {}
    for key, past in (("shared", shared_kv), ("copied", copied_kv)):
        before, batched = calls["shared"], calls["batched"]
        with torch.no_grad():
            out[key] = sample_actions(model, rows, eos_ids=eos, pad_id=0, temperature=1.0, max_new_tokens=10,
                                      past_kv=past, return_kv=True, generator=torch.Generator().manual_seed(3))
        assert (calls["shared"] > before) == (key == "shared")
        assert (calls["batched"] > batched) == (key == "copied" or after > 1)
    assert calls["select"] >= 1  # ended rows were dropped while the prefix was shared
    (ra, kva), (rb, kvb) = out["shared"], out["copied"]
    assert [a for a, _, _ in ra] == [b for b, _, _ in rb]
    assert len({len(a) for a, _, _ in ra}) > 1  # rows ended at different steps
    for (_, la, ca), (_, lb, cb) in zip(ra, rb):
        assert ca == cb and max(abs(x - y) for x, y in zip(la, lb)) < 1e-5
    for x, y in zip(kva, kvb):
        assert x.length == y.length
        for s, t in zip(x.keys + x.values, y.keys + y.values):
            torch.testing.assert_close(s, t, rtol=0, atol=1e-5)


def test_shared_prefix_attention_equals_sdpa_over_the_concatenation():
    """The formula: softmax over [prefix keys, own keys] together, prefix read from the row's
    group; left padding of the prefixes masked; grouped-query heads (n_q = 2)."""
    g = torch.Generator().manual_seed(0)
    S, Hkv, nq, D, W, n = 3, 2, 2, 8, 6, 4
    lengths = [6, 3, 5]
    members = [[0, 3], [1], [2, 4, 5]]
    B = 6
    heads = [RowKV([torch.randn(Hkv, m, D, generator=g)], [torch.randn(Hkv, m, D, generator=g)]) for m in lengths]
    past = [None] * B
    for s, rows in enumerate(members):
        for b in rows:
            past[b] = heads[s]
    shared = SharedPrefix.from_rows(past, W, "cpu")
    assert shared is not None and not shared.identity and shared.groups == 3 and shared.group_size == 3
    q = torch.randn(B, Hkv, nq, D, generator=g)
    own_k, own_v = torch.randn(B, Hkv, n, D, generator=g), torch.randn(B, Hkv, n, D, generator=g)
    mask = torch.ones(B, W + n, dtype=torch.bool)
    for b in range(B):
        mask[b, :W - past[b].length] = False
    mask[1, W + 1] = False  # a padded own position too
    bias = torch.zeros(B, 1, 1, W + n).masked_fill(~mask[:, None, None, :], float("-inf"))
    got = shared_prefix_attention(q, shared, 0, own_k, own_v, bias, D ** -0.5)
    K = torch.cat([shared.expanded(0, "k"), own_k], 2)
    V = torch.cat([shared.expanded(0, "v"), own_v], 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=mask[:, None, None, :], scale=D ** -0.5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    # each row's prefix is its own group's, in the last `length` columns
    for b in range(B):
        torch.testing.assert_close(shared.expanded(0, "k")[b, :, W - past[b].length:], past[b].keys[0])
    # dropping rows keeps each row's group
    keep = torch.tensor([5, 0, 2])
    sub = shared.select(keep)
    sub_bias = bias[keep]
    got_sub = shared_prefix_attention(q[keep], sub, 0, own_k[keep], own_v[keep], sub_bias, D ** -0.5)
    torch.testing.assert_close(got_sub, got[keep], rtol=0, atol=1e-6)


def test_shared_prefix_only_where_it_saves_reads():
    row = RowKV([torch.zeros(1, 3, 2)], [torch.zeros(1, 3, 2)])
    other = RowKV([torch.zeros(1, 2, 2)], [torch.zeros(1, 2, 2)])
    assert SharedPrefix.from_rows([row, row, None], 3, "cpu") is None  # a row without a prefix
    assert SharedPrefix.from_rows([row, _copy(row)], 3, "cpu") is None  # nothing shared
    uneven = [row] * 5 + [other, _copy(other), _copy(other)]
    assert SharedPrefix.from_rows(uneven, 3, "cpu") is None  # 4 groups x 5 slots for 8 rows
    s = SharedPrefix.from_rows([row, row, other, other], 3, "cpu")
    assert s is not None and s.identity
    with pytest.raises(ValueError, match="width"):
        SharedPrefix.from_rows([row, row], 2, "cpu")
    k = torch.zeros(2, 1, 3, 2)
    with pytest.raises(ValueError, match="shared"):
        KVBuffers([(k[:, :, :2], k[:, :, :2])], extra=1, shared=SharedPrefix.from_rows([row, row], 3, "cpu"))


def test_buffers_with_a_shared_prefix_read_back_what_per_row_buffers_hold():
    """layers[l].keys / .values (what cache_layers reads), rows_kv and dropping rows: the same
    per-row keys/values whether the prefix is held once or per row."""
    g = torch.Generator().manual_seed(1)
    H, D, W, T = 2, 4, 5, 8  # prefix width 5, 3 tokens after it
    heads = [RowKV([torch.randn(H, n, D, generator=g)], [torch.randn(H, n, D, generator=g)]) for n in (5, 3)]
    past = [heads[0], heads[0], heads[1], heads[1]]
    mask = torch.ones(4, T, dtype=torch.long)
    mask[2:, :W - 3] = 0
    k = torch.zeros(4, H, T, D)
    v = torch.zeros(4, H, T, D)
    for b, p in enumerate(past):
        k[b, :, W - p.length:W], v[b, :, W - p.length:W] = p.keys[0], p.values[0]
    k[:, :, W:], v[:, :, W:] = torch.randn(4, H, T - W, D, generator=g), torch.randn(4, H, T - W, D, generator=g)
    plain = KVBuffers([(k, v)], extra=2)
    shared = KVBuffers([(k, v)], extra=2, shared=SharedPrefix.from_rows(past, W, "cpu"))
    assert shared.shared is not None and shared.length == plain.length == T and shared.capacity == plain.capacity
    assert shared.k[0].shape[2] == T - W + 2  # only the tokens after the prefix, and room for 2 more
    torch.testing.assert_close(shared.layers[0].keys, plain.layers[0].keys, rtol=0, atol=0)
    torch.testing.assert_close(shared.layers[0].values, plain.layers[0].values, rtol=0, atol=0)
    for bufs in (plain, shared):
        bufs.batch_select_indices(torch.tensor([3, 0]))
    rows = torch.tensor([0, 1])
    sub_mask = mask[torch.tensor([3, 0])]
    for a, b in zip(plain.rows_kv(rows, sub_mask), shared.rows_kv(rows, sub_mask)):
        assert a.length == b.length
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
