"""Checkpoints: round trips, retention, atomicity under crashes and SIGKILL, bad input."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from trajgrad.train import checkpoint as ckpt
from trajgrad.train import _checkpoint_files as ckpt_files
from trajgrad.train.checkpoint import (
    CheckpointState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(model, opt, steps: int, seed: int = 123) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 5, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _assert_state_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_state_equal(x, y)
    else:
        assert a == b


def _draw_all():
    return random.random(), float(np.random.rand()), torch.rand(3)


# ------------------------------------------------------------------------ round trips


def test_round_trip_adamw_parameters_optimizer_and_rng(tmp_path):
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, 3)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    extra = {"data_cursor": 17, "policy_version": 3, "lagrange": {"lambda": 0.25}, "t": torch.tensor(2.5)}
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, extra=extra)
    assert path == tmp_path / "checkpoints" / "step-000003"
    after_save = _draw_all()

    model2 = _mlp(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1)
    _draw_all()  # move the streams away from the saved state
    state = load_checkpoint(tmp_path, model=model2, optimizer=opt2)
    after_load = _draw_all()

    assert isinstance(state, CheckpointState)
    assert state.step == 3 and state.path == path
    assert state.extra == {"data_cursor": 17, "policy_version": 3, "lagrange": {"lambda": 0.25}, "t": 2.5}
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    _assert_state_equal(opt.state_dict(), opt2.state_dict())
    assert after_save[0] == after_load[0]
    assert after_save[1] == after_load[1]
    assert torch.equal(after_save[2], after_load[2])

    # Training continues identically from both copies.
    _train(model, opt, 2, seed=9)
    _train(model2, opt2, 2, seed=9)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_several_modules_optimizers_and_a_scheduler(tmp_path):
    policy, head = _mlp(0), torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    copt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        x = torch.randn(4, 5)
        loss = head(policy(x)).pow(2).mean()
        opt.zero_grad(), copt.zero_grad()
        loss.backward()
        opt.step(), copt.step(), sched.step()
    save_checkpoint(
        tmp_path,
        2,
        modules={"policy": policy, "value_head": head},
        optimizers={"policy": opt, "critic": copt, "sched": sched},
        extra={"k": 1},
    )
    policy2, head2 = _mlp(5), torch.nn.Linear(3, 1)
    opt2 = torch.optim.AdamW(policy2.parameters(), lr=1e-2)
    copt2 = torch.optim.SGD(head2.parameters(), lr=0.1, momentum=0.9)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    load_checkpoint(
        tmp_path,
        modules={"policy": policy2, "value_head": head2},
        optimizers={"policy": opt2, "critic": copt2, "sched": sched2},
    )
    _assert_state_equal(policy.state_dict(), policy2.state_dict())
    _assert_state_equal(head.state_dict(), head2.state_dict())
    _assert_state_equal(opt.state_dict(), opt2.state_dict())
    _assert_state_equal(copt.state_dict(), copt2.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)

    # A subset can be loaded (e.g. the policy alone for evaluation).
    head3 = torch.nn.Linear(3, 1)
    load_checkpoint(tmp_path, modules={"value_head": head3}, restore_rng=False)
    assert torch.equal(head3.weight, head.weight)


def test_trainable_only_saves_only_trainable_parameters(tmp_path):
    from safetensors.torch import load_file

    model = _mlp(0)
    for p in model[0].parameters():
        p.requires_grad_(False)
    path = save_checkpoint(tmp_path, 0, model=model)
    keys = set(load_file(str(path / "modules" / "policy.safetensors")))
    assert keys == {"2.weight", "2.bias"}

    other = _mlp(1)
    frozen_before = other[0].weight.clone()
    for p in other[0].parameters():
        p.requires_grad_(False)
    load_checkpoint(tmp_path, model=other)
    assert torch.equal(other[2].weight, model[2].weight)
    assert torch.equal(other[0].weight, frozen_before)  # frozen part untouched

    full = save_checkpoint(tmp_path / "full", 0, model=model, trainable_only=False)
    assert set(load_file(str(full / "modules" / "policy.safetensors"))) == set(model.state_dict())
    other = _mlp(1)
    load_checkpoint(tmp_path / "full", model=other)
    _assert_state_equal(other.state_dict(), model.state_dict())


def test_tied_weights_full_state_dict(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(6, 4)
            self.out = torch.nn.Linear(4, 6, bias=False)
            self.out.weight = self.emb.weight

    torch.manual_seed(0)
    a = Tied()
    save_checkpoint(tmp_path, 0, model=a, trainable_only=False)
    save_checkpoint(tmp_path / "t", 0, model=a)
    torch.manual_seed(1)
    b = Tied()
    load_checkpoint(tmp_path, model=b)
    assert torch.equal(b.emb.weight, a.emb.weight) and b.out.weight is b.emb.weight
    torch.manual_seed(2)
    c = Tied()
    load_checkpoint(tmp_path / "t", model=c)
    assert torch.equal(c.out.weight, a.emb.weight) and c.out.weight is c.emb.weight


def test_data_parallel_wrapper_is_removed(tmp_path):
    model = _mlp(0)
    save_checkpoint(tmp_path, 1, model=torch.nn.DataParallel(model))
    plain = _mlp(3)
    load_checkpoint(tmp_path, model=plain)
    _assert_state_equal(plain.state_dict(), model.state_dict())


def test_restore_rng_false_leaves_streams_alone(tmp_path):
    save_checkpoint(tmp_path, 0, model=_mlp(0))
    target = _mlp(1)
    torch.manual_seed(99)
    expected = torch.rand(4)
    torch.manual_seed(99)
    load_checkpoint(tmp_path, model=target, restore_rng=False)
    assert torch.equal(torch.rand(4), expected)


def _tiny_lora(base_seed: int, lora_seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(base_seed)
    base = LlamaForCausalLM(config)
    torch.manual_seed(lora_seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(base, lora)


def test_peft_lora_round_trip_on_tiny_llama(tmp_path):
    model = _tiny_lora(0, 1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = save_checkpoint(tmp_path, 2, model=model, optimizer=opt)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["modules"]["policy"]["kind"] == "peft"
    from safetensors.torch import load_file

    keys = list(load_file(str(path / "modules" / "policy.safetensors")))
    assert keys and all("lora_" in k for k in keys)  # the adapter only, not the base

    other = _tiny_lora(0, 2)  # same base weights, different adapter
    opt2 = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    with torch.no_grad():
        assert not torch.allclose(other(input_ids=ids).logits, model(input_ids=ids).logits)
    load_checkpoint(tmp_path, model=other, optimizer=opt2)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    loaded = {n: p for n, p in other.named_parameters() if p.requires_grad}
    assert set(trained) == set(loaded)
    for n in trained:
        assert torch.equal(trained[n], loaded[n]), n
    with torch.no_grad():
        assert torch.equal(other(input_ids=ids).logits, model(input_ids=ids).logits)
    _assert_state_equal(opt.state_dict(), opt2.state_dict())


# ------------------------------------------------------------------------ retention, re-save


def _marked(value: float) -> torch.nn.Module:
    m = torch.nn.Linear(3, 3)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def test_retention_keeps_the_newest(tmp_path):
    for step in range(5):
        save_checkpoint(tmp_path, step, model=_marked(step), keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000003", "step-000004"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000004"

    save_checkpoint(tmp_path, 5, model=_marked(5), keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000005"]

    for step in range(6, 9):
        save_checkpoint(tmp_path, step, model=_marked(step), keep=None)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step-{s:06d}" for s in (5, 6, 7, 8)]


def test_retention_orders_by_save_time_not_step(tmp_path):
    # Resuming from an older checkpoint: the newest *save* is kept, not the largest step.
    for step in (10, 20):
        save_checkpoint(tmp_path, step, model=_marked(step), keep=2)
    save_checkpoint(tmp_path, 11, model=_marked(11), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000020", "step-000011"]
    assert latest_checkpoint(tmp_path).name == "step-000011"


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 3, model=_marked(1.0), extra={"v": 1})
    save_checkpoint(tmp_path, 3, model=_marked(2.0), extra={"v": 2})
    m = _marked(0.0)
    state = load_checkpoint(tmp_path, model=m)
    assert state.extra == {"v": 2} and torch.all(m.weight == 2.0)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000003"]


def test_explicit_path_loads_an_older_checkpoint(tmp_path):
    first = save_checkpoint(tmp_path, 1, model=_marked(1.0), keep=None)
    save_checkpoint(tmp_path, 2, model=_marked(2.0), keep=None)
    m = _marked(0.0)
    assert load_checkpoint(tmp_path, model=m, path=first).step == 1
    assert torch.all(m.weight == 1.0)


# ------------------------------------------------------------------------ crashes


class _Crash(BaseException):
    pass


def _files(step):
    """A further file of the checkpoint (as the asynchronous learners' buffer), carrying its step."""
    return {"async_state.json": json.dumps({"step": step, "buffer": list(range(1000))}).encode()}


def _check_consistent(run_dir, allowed_steps):
    """latest names a complete checkpoint whose weights and further file carry its step number."""
    m = _marked(-1.0)
    state = load_checkpoint(run_dir, model=m, restore_rng=False)
    assert state.step in allowed_steps
    assert state.extra == {"step": state.step}
    assert (state.path / "async_state.json").read_bytes() == _files(state.step)["async_state.json"]
    assert torch.all(m.weight == float(state.step))
    for entry in (run_dir / "checkpoints").iterdir():
        if entry.name.startswith("step-"):
            ckpt._read_manifest(entry)  # every visible step directory is complete
    return state.step


@pytest.mark.parametrize("new_step", [3, 2])  # a new step, and re-saving the latest one
def test_crash_at_every_durable_operation_leaves_old_or_new(tmp_path, monkeypatch, new_step):
    calls = {"n": 0, "at": None}

    def crashing(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == calls["at"]:
                raise _Crash()
            return fn(*args, **kwargs)

        return wrapper

    for name in ("_replace", "_rmtree", "_fsync_dir", "_fsync_file", "_write_bytes", "_write_torch"):
        monkeypatch.setattr(ckpt_files, name, crashing(getattr(ckpt_files, name)))

    crashed_somewhere = 0
    for at in range(1, 200):
        run_dir = tmp_path / f"at{at}"
        calls["at"] = None
        save_checkpoint(run_dir, 1, model=_marked(1), extra={"step": 1}, keep=2, files=_files(1))
        save_checkpoint(run_dir, 2, model=_marked(2), extra={"step": 2}, keep=2, files=_files(2))
        calls["n"], calls["at"] = 0, at
        try:
            save_checkpoint(run_dir, new_step, model=_marked(new_step), extra={"step": new_step}, keep=2, files=_files(new_step))
        except _Crash:
            crashed_somewhere += 1
            _check_consistent(run_dir, {2, new_step})
            calls["at"] = None
            # The next save recovers (sweeps leftovers) and is itself consistent.
            save_checkpoint(run_dir, 4, model=_marked(4), extra={"step": 4}, keep=2, files=_files(4))
            assert _check_consistent(run_dir, {4}) == 4
            leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
            assert len(leftovers) <= 1  # at most the directory the previous ``latest`` named
            continue
        assert _check_consistent(run_dir, {new_step}) == new_step
        break
    else:  # pragma: no cover
        pytest.fail("save_checkpoint never completed")
    assert crashed_somewhere >= 10  # the injection really hit every stage


def test_further_files_are_checked_and_listed(tmp_path):
    path = save_checkpoint(tmp_path, 1, model=_marked(1.0), files=_files(1))
    assert "async_state.json" in json.loads((path / "manifest.json").read_text())["files"]
    data = bytearray((path / "async_state.json").read_bytes())
    data[10] ^= 1  # same size, other bytes: the checksum refuses it
    (path / "async_state.json").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="async_state.json"):
        load_checkpoint(tmp_path, model=_marked(0.0))
    for bad in ({"extra.json": b"{}"}, {"../x": b""}, {".hidden": b""}, {"modules": b""}, {"a.json": "text"}, ["a"]):
        with pytest.raises(ValueError, match="files"):
            save_checkpoint(tmp_path, 2, model=_marked(2.0), files=bad)


# The supervisor imports torch once, then forks a worker per round that checkpoints in a
# loop; the worker is killed with SIGKILL after a random delay and the supervisor checks
# that ``latest`` leads to a complete, self-consistent checkpoint. Forking is safe here:
# one intra-op thread, so no thread pool is copied into a worker.
_SUPERVISOR = textwrap.dedent(
    """
    import json, os, random, signal, sys, time
    import torch
    import safetensors.torch  # imported once here, not in every worker
    torch.set_num_threads(1)
    from trajgrad.train.checkpoint import save_checkpoint, load_checkpoint, latest_checkpoint, _read_manifest

    run_dir, rounds, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # the first optimizer pays lazy imports

    def worker():
        model = torch.nn.Linear(96, 96)
        opt = torch.optim.AdamW(model.parameters())
        step = 0
        if latest_checkpoint(run_dir) is not None:
            step = load_checkpoint(run_dir, model=model, optimizer=opt).step  # re-save it first
        while True:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            save_checkpoint(run_dir, step, model=model, optimizer=opt, extra={"step": step}, keep=2)
            step += 1

    last = -1
    for r in range(rounds):
        pid = os.fork()
        if pid == 0:
            try:
                worker()
            finally:
                os._exit(3)
        time.sleep(rng.uniform(0.02, 0.4))
        done, status = os.waitpid(pid, os.WNOHANG)
        assert done == 0, f"worker died by itself: {status}"
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if latest_checkpoint(run_dir) is None:
            print(json.dumps({"round": r, "step": None}), flush=True)
            continue
        model = torch.nn.Linear(96, 96)
        state = load_checkpoint(run_dir, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                restore_rng=False)
        assert state.extra == {"step": state.step}, state
        assert torch.all(model.weight == float(state.step)) and torch.all(model.bias == float(state.step))
        assert state.step >= last, (state.step, last)
        last = state.step
        for entry in os.scandir(os.path.join(run_dir, "checkpoints")):
            if entry.name.startswith("step-"):
                _read_manifest(__import__("pathlib").Path(entry.path))
        print(json.dumps({"round": r, "step": state.step}), flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigkill_during_repeated_checkpointing_never_tears_latest(tmp_path):
    script = tmp_path / "supervisor.py"
    script.write_text(_SUPERVISOR)
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    rounds = 8
    proc = subprocess.run(
        [sys.executable, str(script), str(run_dir), str(rounds), "1234"],
        capture_output=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    reports = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [r["round"] for r in reports] == list(range(rounds))
    steps = [r["step"] for r in reports if r["step"] is not None]
    assert len(steps) >= rounds - 2  # checkpoints were really being written when killed
    # And from this process: the surviving checkpoint loads and is consistent.
    m = torch.nn.Linear(96, 96)
    state = load_checkpoint(run_dir, model=m, restore_rng=False)
    assert state.step == steps[-1] and torch.all(m.weight == float(state.step))


# ------------------------------------------------------------------------ bad input


def test_no_checkpoint_raises_naming_run_dir(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match="run_dir"):
        load_checkpoint(tmp_path / "nothing", model=_marked(0))


def test_corrupt_checkpoints_raise_naming_run_dir(tmp_path):
    path = save_checkpoint(tmp_path, 1, model=_marked(1), extra={"step": 1})
    latest = tmp_path / "checkpoints" / "latest"

    latest.write_text("../elsewhere\n")
    with pytest.raises(ValueError, match="run_dir"):
        latest_checkpoint(tmp_path)
    latest.write_text("step-000099\n")
    with pytest.raises(ValueError, match="run_dir"):
        load_checkpoint(tmp_path, model=_marked(0))
    latest.write_text("step-000001\n")

    weights = path / "modules" / "policy.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-8])  # truncated file
    with pytest.raises(ValueError, match="run_dir"):
        load_checkpoint(tmp_path, model=_marked(0))
    weights.write_bytes(data)
    (path / "manifest.json").unlink()  # incomplete directory
    with pytest.raises(ValueError, match="run_dir"):
        load_checkpoint(tmp_path, model=_marked(0))


def test_bad_arguments(tmp_path):
    m = _marked(0)
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, model=m)
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, 1.5, model=m)
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, model=m, keep=0)
    with pytest.raises(ValueError, match="extra"):
        save_checkpoint(tmp_path, 1, model=m, extra={"f": object()})
    with pytest.raises(ValueError, match="extra"):
        save_checkpoint(tmp_path, 1, model=m, extra=[1, 2])
    with pytest.raises(ValueError, match="modules"):
        save_checkpoint(tmp_path, 1, modules={"../evil": m})
    with pytest.raises(ValueError, match="modules"):
        save_checkpoint(tmp_path, 1, modules={"policy": "not a module"})
    with pytest.raises(ValueError, match="optimizers"):
        save_checkpoint(tmp_path, 1, optimizers={"opt": object()})
    with pytest.raises(ValueError, match="model"):
        save_checkpoint(tmp_path, 1, model=m, modules={"policy": m})
    with pytest.raises(ValueError, match="run_dir"):
        save_checkpoint(None, 1, model=m)
    assert not (tmp_path / "checkpoints").exists() or latest_checkpoint(tmp_path) is None


def test_mismatched_objects_raise_and_modify_nothing(tmp_path):
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    save_checkpoint(tmp_path, 1, modules={"policy": model}, optimizers={"policy": opt})

    wrong_shape = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    with pytest.raises(ValueError, match="modules"):
        load_checkpoint(tmp_path, model=wrong_shape)
    with pytest.raises(ValueError, match="modules"):
        load_checkpoint(tmp_path, modules={"value_head": torch.nn.Linear(3, 1)})
    extra_trainable = torch.nn.Sequential(_mlp(1), torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="modules"):
        load_checkpoint(tmp_path, model=extra_trainable)
    with pytest.raises(ValueError, match="optimizers"):
        load_checkpoint(tmp_path, model=_mlp(1), optimizers={"critic": opt})

    # A failing optimizer is detected before any module is modified.
    fresh = _mlp(1)
    before = [p.clone() for p in fresh.parameters()]
    with pytest.raises(ValueError, match="optimizers"):
        load_checkpoint(tmp_path, model=fresh, optimizers={"missing": torch.optim.SGD(fresh.parameters(), lr=1)})
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))

    bigger = torch.optim.AdamW(list(_mlp(1).parameters()) + [torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="optimizers"):
        load_checkpoint(tmp_path, model=_mlp(1), optimizer=bigger)


# ------------------------------------------------------------------------ integrity


def _flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("target", ["modules/policy.safetensors", "optimizers/policy.pt", "rng.pt", "extra.json"])
def test_same_size_corruption_is_refused_naming_the_file(tmp_path, target):
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 2)
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, extra={"step": 1})
    size = (path / target).stat().st_size
    _flip_byte(path / target, offset=size - 3 if target == "extra.json" else None)
    assert (path / target).stat().st_size == size
    fresh = _mlp(1)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(ValueError, match="run_dir: corrupt checkpoint: .*" + target.split("/")[-1]):
        load_checkpoint(tmp_path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))  # nothing loaded
    with pytest.raises(ckpt.CorruptCheckpoint) as info:
        ckpt.verify_checkpoint(path)
    assert info.value.file == path / target
    assert latest_checkpoint(tmp_path) == path  # sizes still match: found, but not intact


def test_newest_intact_checkpoint_skips_corrupt_ones(tmp_path):
    p1 = save_checkpoint(tmp_path, 1, model=_marked(1), keep=None)
    p2 = save_checkpoint(tmp_path, 2, model=_marked(2), keep=None)
    assert ckpt.newest_intact_checkpoint(tmp_path) == p2
    _flip_byte(p2 / "modules" / "policy.safetensors")
    assert ckpt.newest_intact_checkpoint(tmp_path) == p1
    assert ckpt.newest_intact_checkpoint(tmp_path, exclude=[p1]) is None
    m = _marked(0)
    assert load_checkpoint(tmp_path, model=m, path=p1, restore_rng=False).step == 1
    assert torch.all(m.weight == 1.0)


def test_missing_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, model=_marked(1), keep=None)
    p3 = save_checkpoint(tmp_path, 3, model=_marked(3), keep=None)
    save_checkpoint(tmp_path, 2, model=_marked(2), keep=None)  # newest by save time
    (tmp_path / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000002"
    (tmp_path / "checkpoints" / "step-000002" / "manifest.json").unlink()  # torn: skipped
    assert latest_checkpoint(tmp_path) == p3
    m = _marked(0)
    assert load_checkpoint(tmp_path, model=m, restore_rng=False).step == 3 and torch.all(m.weight == 3.0)


def test_format_1_manifest_without_checksums_still_loads(tmp_path):
    path = save_checkpoint(tmp_path, 1, model=_marked(1))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = 1
    manifest["files"] = {rel: e["size"] for rel, e in manifest["files"].items()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    m = _marked(0)
    assert load_checkpoint(tmp_path, model=m, restore_rng=False).step == 1 and torch.all(m.weight == 1.0)
