"""trajgrad.weights: trainable state, module states, safetensors / adapter / checkpoint readers.

Every reader checks before it copies: a bad file raises ValueError naming ``path`` (or
``state`` / ``modules``) and leaves the model bitwise unchanged; a good one makes the
target equal to the source.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajgrad.model.tiny import build_tiny_model
from trajgrad.weights import (
    ReferenceWeights,
    adapter_loader,
    checkpoint_module_loader,
    file_tensors,
    is_checkpoint,
    is_peft,
    load_trainable_state,
    module_state,
    module_state_loader,
    named_tensors_loader,
    safetensors_files,
    save_trainable,
    trainable_state,
    unwrap,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _lora(model, r=4):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    wrapped = get_peft_model(copy.deepcopy(model), cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(r)
        for n, p in wrapped.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return wrapped


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def pair(tok):
    return build_tiny_model(tok, seed=0, hidden_size=32), build_tiny_model(tok, seed=1, hidden_size=32)


# ----------------------------------------------------------------------------- state
def test_unwrap_and_is_peft(pair):
    a, _ = pair
    assert unwrap(torch.nn.DataParallel(a)) is a
    assert not is_peft(a)
    assert is_peft(_lora(a))


def test_trainable_state_roundtrip_and_errors(pair):
    a, b = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    for p in a.parameters():
        p.requires_grad_(False)
    a.lm_head.weight.requires_grad_(True)  # tied to the embedding
    state = trainable_state(a)
    assert list(state) == ["model.embed_tokens.weight"] or list(state) == ["lm_head.weight"]
    assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())
    assert load_trainable_state(b, state) == 1
    name = next(iter(state))
    assert torch.equal(dict(b.named_parameters())[name], dict(a.named_parameters())[name])
    before = _snapshot(b)
    good = {name: state[name] + 1}
    # a bad entry anywhere leaves every parameter untouched (checked before any copy)
    with pytest.raises(ValueError, match="state: 'nope'"):
        load_trainable_state(b, {**good, "nope": state[name]})
    with pytest.raises(ValueError, match="state: .* has shape"):
        load_trainable_state(b, {**good, "model.norm.weight": torch.zeros(3)})
    assert _same(before, b.state_dict())
    with pytest.raises(ValueError, match="model: has no trainable parameters"):
        trainable_state(torch.nn.Linear(2, 2).requires_grad_(False))


@pytest.mark.parametrize("kind", ["trainable", "full", "peft"])
def test_module_state_loader_makes_the_target_equal(pair, kind):
    src, dst = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    if kind == "peft":
        src, dst = _lora(src, r=4), _lora(src, r=4)
        with torch.no_grad():
            for n, p in dst.named_parameters():
                if "lora_" in n:
                    p.zero_()
    got_kind, state, adapter = module_state(src, trainable_only=kind != "full")
    assert got_kind == kind and (adapter == "default") == (kind == "peft")
    apply = module_state_loader("policy", dst, got_kind, file_tensors("policy", state), adapter=adapter)
    apply()
    assert _same(_snapshot(src), _snapshot(dst))


def test_module_state_loader_errors_name_modules(pair):
    a, b = pair
    _, state, _ = module_state(a, trainable_only=True)
    with pytest.raises(ValueError, match="modules: 'policy' has no parameters"):
        module_state_loader("policy", b, "trainable", {"x.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="modules: 'policy' trainable parameters"):
        module_state_loader("policy", b, "trainable", {})
    assert module_state_loader("policy", b, "trainable", {}, require_all_trainable=False) is not None
    with pytest.raises(ValueError, match="modules: 'policy' 'model.norm.weight' has shape"):
        module_state_loader("policy", b, "trainable", {**state, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="modules: 'policy' was saved as a peft adapter"):
        module_state_loader("policy", b, "peft", {})
    with pytest.raises(ValueError, match="modules: 'policy' does not match"):
        module_state_loader("policy", b, "full", {})
    with pytest.raises(ValueError, match="unknown kind"):
        module_state_loader("policy", b, "???", {})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 6), step=st.integers(1, 3), shared=st.booleans())
def test_file_tensors_own_their_storage(n, step, shared):
    """Views and shared storages are cloned; the values are unchanged."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"view": base[:, ::step][:, :n], "whole": base}
    if shared:
        state["again"] = base
    out = file_tensors("m", state)
    ptrs = [t.untyped_storage().data_ptr() for t in out.values()]
    assert len(set(ptrs)) == len(ptrs)
    for k in state:
        assert torch.equal(out[k], state[k]) and out[k].is_contiguous()
    with pytest.raises(ValueError, match="modules: 'm' state entry 'x' is not a tensor"):
        file_tensors("m", {"x": 1.0})


# ----------------------------------------------------------------------------- files
def test_save_trainable_and_named_tensors_loader(pair, tmp_path):
    src, dst = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    path = save_trainable(src, tmp_path / "trainable.safetensors", {"version": 3})
    assert safetensors_files(tmp_path) == [path] and safetensors_files(path) == [path]
    assert safetensors_files(tmp_path / "nothing") is None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata()["version"] == "3" and f.metadata()["content"] == "trainable_parameters"
    before = _snapshot(dst)
    apply, n = named_tensors_loader(dst, [path])
    assert n == len(trainable_state(src)) and _same(before, _snapshot(dst))  # nothing copied yet
    assert apply() is dst
    assert _same(_snapshot(src), _snapshot(dst))
    with pytest.raises(ValueError, match="model: has no parameter with requires_grad"):
        save_trainable(torch.nn.Linear(2, 2).requires_grad_(False), tmp_path / "x.safetensors")


def test_named_tensors_loader_refuses_bad_files(pair, tmp_path):
    from safetensors.torch import save_file

    _, dst = pair
    w = dst.model.norm.weight.detach().clone()
    bad_nan = w.clone()
    bad_nan[0] = float("nan")
    cases = {
        "unknown": {"no.such": w},
        "shape": {"model.norm.weight": w[:3].clone()},
        "nan": {"model.norm.weight": bad_nan},
    }
    before = _snapshot(dst)
    for name, tensors in cases.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(ValueError, match="^path: "):
            named_tensors_loader(dst, [tmp_path / f"{name}.safetensors"])
    (tmp_path / "garbage.safetensors").write_bytes(b"\x01garbage" * 9)
    with pytest.raises(ValueError, match="^path: cannot read"):
        named_tensors_loader(dst, [tmp_path / "garbage.safetensors"])
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="^path: unreadable shard index"):
        safetensors_files(tmp_path / "shards")
    assert _same(before, _snapshot(dst))


def test_adapter_loader_wraps_or_updates_and_checks(pair, tmp_path):
    base = pair[0]
    policy = _lora(base, r=4)
    policy.save_pretrained(tmp_path / "a")
    # a plain model is wrapped by its first adapter
    plain = copy.deepcopy(base)
    apply, n = adapter_loader(plain, tmp_path / "a")
    assert n > 0 and not is_peft(plain)
    wrapped = apply()
    assert is_peft(wrapped) and not wrapped.training
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(wrapped(x).logits, policy.eval()(x).logits, atol=1e-6)
    # an adapter-served model gets the new adapter values in place
    served = _lora(base, r=4)
    with torch.no_grad():
        for name, p in served.named_parameters():
            if "lora_" in name:
                p.zero_()
    apply, _ = adapter_loader(served, tmp_path / "a")
    assert apply() is served
    with torch.no_grad():
        assert torch.allclose(served(x).logits, policy(x).logits, atol=1e-6)
    # another rank is refused, naming the field
    _lora(base, r=2).save_pretrained(tmp_path / "r2")
    with pytest.raises(ValueError, match="^path: adapter_config.json has r=2"):
        adapter_loader(served, tmp_path / "r2")
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"junk")
    for model in (copy.deepcopy(base), served):
        with pytest.raises(ValueError, match="^path: cannot read the adapter weights"):
            adapter_loader(model, tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="^path: adapter_config.json .* is not a JSON object"):
        adapter_loader(served, tmp_path / "a")


def test_checkpoint_module_loader_reads_what_save_checkpoint_writes(pair, tmp_path):
    """The serve-side reader gives the weights that ``load_checkpoint`` gives."""
    from trajgrad.train.checkpoint import load_checkpoint, save_checkpoint

    src = copy.deepcopy(pair[0])
    with torch.no_grad():
        src.model.norm.weight.add_(0.25)
    step_dir = save_checkpoint(tmp_path / "run", 3, model=src, modules={"value_head": torch.nn.Linear(2, 1)})
    reference = copy.deepcopy(pair[1])
    load_checkpoint(tmp_path / "run", model=reference, restore_rng=False)
    for path in (tmp_path / "run", step_dir):
        assert is_checkpoint(path)
        dst = copy.deepcopy(pair[1])
        apply, n = checkpoint_module_loader(dst, path)
        assert n == len(trainable_state(src))
        apply()
        assert _same(_snapshot(reference), _snapshot(dst))
    assert not is_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="^path: the checkpoint .* has no module 'critic'"):
        checkpoint_module_loader(copy.deepcopy(pair[1]), step_dir, name="critic")
    weights = step_dir / "modules" / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match="^path: .* bytes, the manifest says"):
        checkpoint_module_loader(copy.deepcopy(pair[1]), step_dir)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("../x\n")
    with pytest.raises(ValueError, match="^path: .*latest is corrupt"):
        checkpoint_module_loader(copy.deepcopy(pair[1]), tmp_path / "run")


def test_reference_weights_swap_and_restore(pair):
    model = copy.deepcopy(pair[0])
    ref = ReferenceWeights(model)
    x = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        before = model(x).logits.clone()
        model.model.norm.weight.mul_(2.0)
        moved = model(x).logits.clone()
        with ref.applied(model):
            assert torch.equal(model(x).logits, before)
        assert torch.equal(model(x).logits, moved)
    with pytest.raises(ValueError, match="model: has no trainable parameters"):
        ReferenceWeights(torch.nn.Linear(2, 2).requires_grad_(False))


# ----------------------------------------------------------------------------- layering
def test_layers_import_downward_only():
    """model/ and weights import neither rollout/, train/ nor serve/; serve imports no train/."""
    import pkgutil
    import subprocess
    import sys

    import trajgrad.model

    model_modules = [f"trajgrad.model.{m.name}" for m in pkgutil.iter_modules(trajgrad.model.__path__)]
    show = "print(' '.join(sorted(m for m in sys.modules if m.startswith('trajgrad'))))"
    script = "\n".join(["import sys", *(f"import {m}" for m in model_modules), "import trajgrad.weights", show,
                        "import trajgrad.serve", show])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    below, served = (set(line.split()) for line in out.stdout.strip().splitlines())
    assert "trajgrad.model.learner" in below and "trajgrad.weights.files" in below
    assert not {m for m in below if m.startswith(("trajgrad.rollout", "trajgrad.train", "trajgrad.serve"))}
    assert "trajgrad.serve.reload" in served and not {m for m in served if m.startswith("trajgrad.train")}
