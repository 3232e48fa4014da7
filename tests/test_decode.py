"""The lean decode step (model/decode.py) computes what the Hugging Face forward computes."""
import pytest
import torch

from trajgrad.model.decode import KVBuffers, decode_step, fast_backbone
from trajgrad.model.positions import position_ids_from_attention_mask
from trajgrad.model.tiny import build_tiny_model
from trajgrad.rollout.generation import sample_actions


pytestmark = pytest.mark.usefixtures("one_thread")


def _lora(model):
    peft = pytest.importorskip("peft")
    m = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                        "o_proj", "up_proj"]))
    with torch.no_grad():  # make the adapters matter (B starts at zero)
        gen = torch.Generator().manual_seed(0)
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return m


MODELS = {
    "mha": lambda tok: build_tiny_model(tok, hidden_size=64, layers=2, heads=4, seed=0, initializer_range=0.2),
    "gqa": lambda tok: build_tiny_model(tok, hidden_size=96, layers=3, heads=6, kv_heads=2, seed=1, initializer_range=0.2),
    "gqa+lora": lambda tok: _lora(build_tiny_model(tok, hidden_size=96, layers=2, heads=6, kv_heads=3, seed=2,
                                                   initializer_range=0.2)),
}


def _rows(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 90, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_step_equals_the_full_forward(tok, name):
    """Run a left-padded prompt, then tokens one at a time with decode_step: every step's
    final hidden state equals the Hugging Face forward over the whole sequence."""
    model = MODELS[name](tok).eval()
    backbone = fast_backbone(model)
    assert backbone is not None
    rows = _rows()
    extra = [torch.randint(5, 90, (5,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(len(rows))]
    T = max(map(len, rows))
    ids = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    with torch.no_grad():
        out = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_attention_mask(mask), use_cache=True)
        cache = out.past_key_values if hasattr(out, "past_key_values") and out.past_key_values is not None else out.cache
        bufs = KVBuffers([(layer.keys, layer.values) for layer in cache.layers], extra=5)
        for j in range(5):
            tok_j = torch.tensor([e[j] for e in extra])
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], 1)
            pos = position_ids_from_attention_mask(mask)[:, -1]
            h = decode_step(backbone, bufs, tok_j, pos, mask)
            full_ids = torch.cat([ids, torch.tensor([e[:j + 1] for e in extra])], 1)
            ref = backbone(input_ids=full_ids, attention_mask=mask,
                           position_ids=position_ids_from_attention_mask(mask)).last_hidden_state[:, -1]
            torch.testing.assert_close(h, ref, rtol=0, atol=2e-5)
        assert bufs.length == T + 5 and bufs.capacity == T + 5


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)],
                         ids=["greedy", "T1", "T0.8-p0.9"])
def test_sample_actions_fast_equals_the_model_forward(tok, name, sampling, monkeypatch):
    """Same generator, same rows: the same tokens, log-probs within 1e-6, and the same
    per-row keys/values for the next turn; then a second turn from those keys/values."""
    import trajgrad.rollout.generation as sampler_mod

    calls = []

    def counted(*a, **k):
        calls.append(1)
        return decode_step(*a, **k)

    monkeypatch.setattr(sampler_mod, "decode_step", counted)
    model = MODELS[name](tok).eval()
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    rows = _rows(8, seed=3)
    res = {}
    for fast in (False, True):
        with torch.no_grad():
            first, kv = sample_actions(model, rows, eos_ids=eos, pad_id=0, max_new_tokens=12, return_kv=True,
                                       generator=torch.Generator().manual_seed(0), fast_decode=fast, **sampling)
            ctx = [r + a + [7, 8, 9] for r, (a, _, _) in zip(rows, first)]
            second = sample_actions(model, ctx, eos_ids=eos, pad_id=0, max_new_tokens=12, past_kv=kv,
                                    generator=torch.Generator().manual_seed(1), fast_decode=fast, **sampling)
        res[fast] = (first, kv, second)
        assert bool(calls) == fast  # the lean step ran only when asked
    (f0, kv0, s0), (f1, kv1, s1) = res[False], res[True]
    for a, b in zip(f0 + s0, f1 + s1):
        assert a[0] == b[0] and a[2] == b[2]
        assert max((abs(x - y) for x, y in zip(a[1], b[1])), default=0.0) < 1e-6
    assert sum(len(a[0]) for a in f0) > len(rows)  # actions longer than one token were decoded
    for ra, rb in zip(kv0, kv1):
        assert ra.length == rb.length
        for x, y in zip(ra.keys + ra.values, rb.keys + rb.values):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


def test_fast_backbone_only_where_it_computes_the_same_function(tok):
    model = build_tiny_model(tok, hidden_size=32, layers=1, heads=2)
    assert fast_backbone(model.eval()) is model.model
    assert fast_backbone(model.train()) is None  # dropout and training-only behaviour: the model's forward
    eager = build_tiny_model(tok, hidden_size=32, layers=1, heads=2, attn_implementation="eager").eval()
    assert fast_backbone(eager) is None
    assert fast_backbone(torch.nn.Linear(2, 2)) is None
    peft_model = _lora(build_tiny_model(tok, hidden_size=32, layers=1, heads=2)).eval()
    assert fast_backbone(peft_model) is peft_model.get_base_model().model


def test_decode_step_bad_input(tok):
    model = build_tiny_model(tok, hidden_size=32, layers=1, heads=2).eval()
    k = torch.zeros((2, 2, 3, 16))
    bufs = KVBuffers([(k, k.clone())], extra=1)
    token, pos = torch.tensor([5, 6]), torch.tensor([3, 3])
    with pytest.raises(ValueError, match="attention_mask"):
        decode_step(model.model, bufs, token, pos, torch.ones((2, 3), dtype=torch.long))
    decode_step(model.model, bufs, token, pos, torch.ones((2, 4), dtype=torch.long))
    with pytest.raises(ValueError, match="buffers: full"):
        decode_step(model.model, bufs, token, pos + 1, torch.ones((2, 5), dtype=torch.long))
    with pytest.raises(ValueError, match="extra"):
        KVBuffers([(k, k)], extra=-1)
    with pytest.raises(ValueError, match="fast_decode"):
        sample_actions(model, [[5, 6]], eos_ids=[1], pad_id=0, fast_decode="yes")
    with pytest.raises(ValueError, match="kv_heads"):
        build_tiny_model(tok, hidden_size=32, layers=1, heads=4, kv_heads=3)
