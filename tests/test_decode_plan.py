"""The decode step's plan (model/decode_plan.py): fused calls that compute the layers' own function."""
import pytest
import torch

import trajgrad.model.decode_plan as plan_mod
from trajgrad.model.decode import KVBuffers, decode_step
from trajgrad.model.decode_plan import DecodePlan, rope
from trajgrad.model.positions import position_ids_from_attention_mask
from trajgrad.model.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _biased(tok):
    """A Llama with biases on the attention and MLP projections (as Qwen-style checkpoints have)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                      max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.3)
    return model.eval()


def _lora(model):
    peft = pytest.importorskip("peft")
    m = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.3)
    return m.eval()


def _decode_all(model, plan_for, steps=4):
    """Hidden states of ``steps`` decode steps after a left-padded prompt, with the plan ``plan_for(backbone)``."""
    backbone = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    rows = [[5, 9, 11, 3], [7, 8], [12, 13, 14, 15, 16, 17]]
    T = max(map(len, rows))
    ids = torch.zeros((3, T), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    out = []
    with torch.no_grad():
        res = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_attention_mask(mask),
                       use_cache=True)
        cache = res.past_key_values if getattr(res, "past_key_values", None) is not None else res.cache
        bufs = KVBuffers([(layer.keys, layer.values) for layer in cache.layers], extra=steps)
        plan = plan_for(backbone)
        for j in range(steps):
            mask = torch.cat([mask, torch.ones((3, 1), dtype=torch.long)], 1)
            pos = position_ids_from_attention_mask(mask)[:, -1]
            out.append(decode_step(backbone, bufs, torch.tensor([20 + j, 30 + j, 40 + j]), pos, mask, plan=plan))
    return torch.stack(out)


@pytest.mark.parametrize("name", ["plain", "gqa", "biased", "lora"])
def test_fused_plan_computes_what_the_modules_compute(tok, name):
    """Stacked q|k|v and gate|up, functional RMSNorm and the rotary table: the same hidden
    states as calling each module (1e-6, float32), for plain, grouped-query, biased and
    LoRA-wrapped layers; and the plan fuses exactly the layers it may."""
    if name == "plain":
        model = build_tiny_model(tok, hidden_size=64, layers=2, heads=4, seed=0, initializer_range=0.2).eval()
    elif name == "gqa":
        model = build_tiny_model(tok, hidden_size=96, layers=2, heads=6, kv_heads=2, seed=1, initializer_range=0.2).eval()
    elif name == "biased":
        model = _biased(tok)
    else:
        model = _lora(build_tiny_model(tok, hidden_size=64, layers=2, heads=4, seed=2, initializer_range=0.2))
    fused = _decode_all(model, lambda bb: DecodePlan(bb, max_position=64))
    reference = _decode_all(model, DecodePlan.modules_only)
    backbone_ = model.get_base_model().model if name == "lora" else model.model
    ref_plan = DecodePlan.modules_only(backbone_)
    assert ref_plan.table is None and ref_plan.final_norm is backbone_.norm
    assert all(p.qkv is None and p.gate_up is None and p.norm_in is layer.input_layernorm
               for p, layer in zip(ref_plan.layers, backbone_.layers))  # the reference fuses nothing
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-6)
    backbone = model.get_base_model().model if name == "lora" else model.model
    plan = DecodePlan(backbone, max_position=64)
    assert all((p.qkv is None) == (name == "lora") for p in plan.layers)  # adapters: the modules are called
    assert all(p.gate_up is not None for p in plan.layers)
    if name == "biased":
        assert all(p.qkv[1] is not None and p.gate_up[1] is not None for p in plan.layers)
    assert plan.table is not None


def test_stacked_weights_are_the_layers_weights(tok):
    model = build_tiny_model(tok, hidden_size=32, layers=1, heads=2, seed=0).eval()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    plan = DecodePlan(model.model)
    W, b, sizes = plan.layers[0].qkv
    assert b is None and sizes == [32, 32, 32]
    assert torch.equal(W, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert not W.requires_grad and W.data_ptr() != attn.q_proj.weight.data_ptr()  # a copy, outside autograd
    W, _, sizes = plan.layers[0].gate_up
    assert torch.equal(W, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])) and sizes == [64, 64]


def test_large_layers_are_not_stacked(tok, monkeypatch):
    """Above FUSE_MAX_ELEMENTS the weights are not copied; the modules are called (same values)."""
    model = build_tiny_model(tok, hidden_size=64, layers=2, heads=4, seed=0, initializer_range=0.2).eval()
    reference = _decode_all(model, lambda bb: DecodePlan(bb, max_position=64))
    monkeypatch.setattr(plan_mod, "FUSE_MAX_ELEMENTS", 64 * 64 * 3 - 1)  # q|k|v is 3 * 64 * 64
    plan = DecodePlan(model.model)
    assert all(p.qkv is None for p in plan.layers) and all(p.gate_up is None for p in plan.layers)
    torch.testing.assert_close(_decode_all(model, lambda bb: DecodePlan(bb, max_position=64)), reference,
                               rtol=0, atol=1e-6)


def test_rotary_table_is_the_models_rotary_embedding(tok):
    """The table holds rotary_emb's values bit for bit; positions past it call rotary_emb."""
    model = build_tiny_model(tok, hidden_size=64, layers=1, heads=4, seed=0).eval()
    backbone = model.model
    plan = DecodePlan(backbone, max_position=40)
    x = torch.zeros((3, 1, 64))
    pos = torch.tensor([0, 17, 40])
    cos, sin = plan.cos_sin(x, pos)
    ref_cos, ref_sin = backbone.rotary_emb(x, pos[:, None])
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    far = torch.tensor([3, 41, 300])  # beyond the table: computed
    cos, sin = plan.cos_sin(x, far)
    ref_cos, ref_sin = backbone.rotary_emb(x, far[:, None])
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert DecodePlan(backbone).table is None


def test_rope_is_the_llama_formula():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 1, 16, generator=g), torch.randn(5, 2, 1, 16, generator=g)
    cos, sin = torch.randn(5, 1, 16, generator=g), torch.randn(5, 1, 16, generator=g)
    rq, rk = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(rope(q[:, :, 0], cos, sin), rq[:, :, 0]) and torch.equal(rope(k[:, :, 0], cos, sin), rk[:, :, 0])


def test_bfloat16_norms_call_the_module(tok):
    model = build_tiny_model(tok, hidden_size=32, layers=1, heads=2, seed=0, dtype=torch.bfloat16).eval()
    plan = DecodePlan(model.model)
    assert plan.layers[0].norm_in is model.model.layers[0].input_layernorm
    assert plan.final_norm is model.model.norm


def test_plan_bad_input(tok):
    a = build_tiny_model(tok, hidden_size=32, layers=1, heads=2, seed=0).eval()
    b = build_tiny_model(tok, hidden_size=32, layers=1, heads=2, seed=1).eval()
    with pytest.raises(ValueError, match="max_position"):
        DecodePlan(a.model, max_position=-1)
    with pytest.raises(ValueError, match="max_position"):
        DecodePlan(a.model, max_position=2.5)
    k = torch.zeros((2, 2, 3, 16))
    bufs = KVBuffers([(k, k.clone())], extra=1)
    with pytest.raises(ValueError, match="plan: made for another backbone"):
        decode_step(a.model, bufs, torch.tensor([5, 6]), torch.tensor([3, 3]), torch.ones((2, 4), dtype=torch.long),
                    plan=DecodePlan(b.model))
