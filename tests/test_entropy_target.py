"""Adaptive entropy control: the bonus with the coefficient of the step, the update rule,
explain, validation, and the coefficient carried through checkpoints (resume is exact)."""
import math

import pytest
import torch

from trajgrad import losses
from trajgrad.aggregate import aggregate
from trajgrad.logprobs import entropy as token_entropy
from trajgrad.logprobs import token_logprobs
from trajgrad.objective import RECIPES, explain, get_recipe
from trajgrad.train import _checkpoint_state
from trajgrad.train.checkpoint import load_checkpoint, save_checkpoint

F64 = torch.float64
B, L, V = 6, 5, 7


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g, dtype=F64)
    targets = torch.randint(0, V, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[:, 0] = True
    old = token_logprobs(logits, targets) + 0.05 * torch.randn(B, L, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)[:, None].expand(B, L)
    return logits, targets, mask, old, adv


def test_bonus_value_and_gradient_use_the_current_coefficient():
    logits, targets, mask, old, adv = _data()
    o = get_recipe("dapo", entropy_target=1.0, entropy_coef=0.03)
    x = logits.clone().requires_grad_(True)
    res = o.policy_loss(token_logprobs(x, targets), adv, mask, old_logp=old, entropy=token_entropy(x))
    y = logits.clone().requires_grad_(True)
    lp = token_logprobs(y, targets)
    ppo = losses.ppo_clip_loss(lp, old, adv, mask, eps_low=o.eps_low, eps_high=o.eps_high_, aggregation=o.aggregation)
    manual = ppo.loss - 0.03 * aggregate(token_entropy(y), mask, o.aggregation)
    assert torch.allclose(res.loss, manual, atol=1e-12)
    (gx,), (gy,) = torch.autograd.grad(res.loss, x), torch.autograd.grad(manual, y)
    assert torch.allclose(gx, gy, atol=1e-12)
    # analytic gradient of the bonus alone: d(-c H_t)/dz_tv = c p_v (log p_v + H_t), token mean
    z = logits.clone().requires_grad_(True)
    bonus = o.replace(entropy_coef=0.03).policy_loss(token_logprobs(z, targets), torch.zeros(B, L, dtype=F64), mask,
                                                     old_logp=old, entropy=token_entropy(z)).loss
    (gz,) = torch.autograd.grad(bonus, z)
    logp = torch.log_softmax(logits, -1)
    p, H = logp.exp(), -(logp.exp() * logp).sum(-1, keepdim=True)
    want = torch.where(mask[..., None], 0.03 * p * (logp + H), 0.0) / mask.sum()
    assert torch.allclose(gz, want, atol=1e-12)
    # the coefficient of the step is what changes the loss; at c = 0 the bonus is absent
    zero = o.replace(entropy_coef=0.0).policy_loss(token_logprobs(logits, targets), adv, mask, old_logp=old)
    assert torch.allclose(zero.loss, ppo.loss.detach(), atol=1e-12)


def test_update_rule_by_hand():
    o = get_recipe("grpo", entropy_target=0.8, entropy_coef=0.01, entropy_coef_lr=0.02, entropy_coef_max=0.05)
    assert o.adaptive_entropy and not RECIPES["grpo"].adaptive_entropy
    assert o.next_entropy_coef(0.3) == pytest.approx(0.01 + 0.02 * 0.5)  # below the target: grows
    assert o.next_entropy_coef(1.3) == pytest.approx(0.01 - 0.02 * 0.5)  # above: shrinks
    assert o.next_entropy_coef(0.8) == pytest.approx(0.01)
    assert o.next_entropy_coef(3.0) == 0.0  # never negative
    assert o.next_entropy_coef(0.0) == pytest.approx(0.026)
    assert o.replace(entropy_coef=0.045).next_entropy_coef(0.0) == 0.05  # capped at entropy_coef_max
    c, hs = 0.0, [0.5, 0.6, 0.9, 1.2, 0.1]
    for h in hs:  # the sequence a trainer would follow
        want = min(max(c + 0.02 * (0.8 - h), 0.0), 0.05)
        c = o.replace(entropy_coef=c).next_entropy_coef(h)
        assert c == pytest.approx(want, abs=1e-15)
    with pytest.raises(ValueError, match="^entropy_target"):
        RECIPES["grpo"].next_entropy_coef(0.5)
    for bad in (math.nan, -0.1, math.inf, "1"):
        with pytest.raises(ValueError, match="^entropy"):
            o.next_entropy_coef(bad)


def test_explain_prints_the_rule_and_the_current_coefficient():
    o = get_recipe("grpo", entropy_target=0.7, entropy_coef_lr=0.003, entropy_coef_max=0.02)
    text = explain(o)
    assert "c ← clip(c + 0.003 · (0.7 − H̄), 0, 0.02)" in text and "c = 0 now" in text
    assert "c = 0.015 now" in explain(o.replace(entropy_coef=0.015))
    assert "adaptive" not in explain(RECIPES["grpo"])
    for f, v in (("entropy_target", 0.9), ("entropy_coef_lr", 0.004), ("entropy_coef_max", 0.03)):
        assert explain(o.replace(**{f: v})) != text, f


def test_fields_without_effect_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="^entropy_coef_lr: has no effect"):
        get_recipe("grpo", entropy_coef_lr=0.1)
    with pytest.raises(ValueError, match="^entropy_coef_max: has no effect"):
        get_recipe("ppo", entropy_coef_max=0.1)
    with pytest.raises(ValueError, match="^entropy_target"):
        get_recipe("dpo", entropy_target=0.5)
    with pytest.raises(ValueError, match="^entropy_target"):
        get_recipe("opd", entropy_target=0.5)
    for field, bad in (("entropy_target", -0.1), ("entropy_target", math.nan), ("entropy_target", "high"),
                       ("entropy_target", True), ("entropy_coef_lr", 0.0), ("entropy_coef_lr", math.inf),
                       ("entropy_coef_max", 0.0), ("entropy_coef_max", -1.0)):
        with pytest.raises(ValueError, match=f"^{field}"):
            get_recipe("grpo", **{"entropy_target": 0.5, field: bad})
    with pytest.raises(ValueError, match="^entropy_coef: must lie in"):
        get_recipe("grpo", entropy_target=0.5, entropy_coef=0.2, entropy_coef_max=0.1)
    with pytest.raises(ValueError, match="^value"):
        _checkpoint_state.set_entropy_coef_state(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), -1.0)


def test_the_coefficient_round_trips_through_a_checkpoint(tmp_path):
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    assert _checkpoint_state.entropy_coef_state(opt, 0.004) == 0.004  # the start value until a step sets one
    _checkpoint_state.set_entropy_coef_state(opt, 0.0123456789)
    save_checkpoint(tmp_path, 3, modules={"policy": net}, optimizers={"policy": opt})
    net2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-3)
    assert _checkpoint_state.entropy_coef_state(opt2, 0.0) == 0.0
    load_checkpoint(tmp_path, modules={"policy": net2}, optimizers={"policy": opt2})
    assert _checkpoint_state.entropy_coef_state(opt2, 0.0) == 0.0123456789  # exact, not the start value


def test_trainer_adapts_logs_and_resumes_the_coefficient_exactly(tmp_path):
    from test_train import micro_config

    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.trainer import Trainer

    over = {"entropy_target": 5.0, "entropy_coef": 0.01, "entropy_coef_lr": 0.002, "entropy_coef_max": 0.05}

    def cfg(steps):
        return micro_config("grpo", recipe={"name": "grpo", "overrides": over}, sft={"steps": 0},
                            train={"steps": steps})

    def rows(run):
        return [r for r in read_metrics(run) if r["kind"] == "train"]

    torch.manual_seed(0)
    Trainer(cfg(3), tmp_path / "full", console=lambda *_: None).run()
    full = rows(tmp_path / "full")
    assert [r["step"] for r in full] == [1, 2, 3]
    assert full[0]["entropy_control/coef"] == 0.01
    for a, b in zip(full, full[1:]):
        o = get_recipe("grpo", **{**over, "entropy_coef": a["entropy_control/coef"]})
        assert a["entropy_control/next_coef"] == pytest.approx(o.next_entropy_coef(a["entropy_control/measured"]),
                                                               abs=1e-15)
        assert b["entropy_control/coef"] == a["entropy_control/next_coef"]
    assert full[0]["entropy_control/measured"] < 5.0 and full[1]["entropy_control/coef"] > 0.01  # below: grows
    assert all(r["entropy_bonus_term"] > 0 for r in full)
    torch.manual_seed(0)
    Trainer(cfg(2), tmp_path / "part", console=lambda *_: None).run()
    tr = Trainer(cfg(3), tmp_path / "part", resume=True, console=lambda *_: None)
    assert _checkpoint_state.entropy_coef_state(tr.optimizer, -1.0) == full[1]["entropy_control/next_coef"]
    tr.run()
    resumed = rows(tmp_path / "part")
    assert resumed[-1]["step"] == 3
    for k in ("entropy_control/coef", "entropy_control/measured", "entropy_control/next_coef", "loss"):
        assert resumed[-1][k] == full[-1][k], k


def test_core_rule_names_each_bad_argument():
    from trajgrad.entropy_control import next_entropy_coef

    assert next_entropy_coef(0.01, 0.2, target=0.7, lr=0.1, coef_max=1.0) == pytest.approx(0.06)
    for kw, name in ((dict(coef=math.nan), "coef"), (dict(entropy=-1.0), "entropy"), (dict(target=math.inf), "target"),
                     (dict(lr=0.0), "lr"), (dict(coef_max=0.0), "coef_max"), (dict(lr=True), "lr")):
        args = {"coef": 0.01, "entropy": 0.2, "target": 0.7, "lr": 0.1, "coef_max": 1.0, **kw}
        with pytest.raises(ValueError, match=f"^{name}:"):
            next_entropy_coef(args.pop("coef"), args.pop("entropy"), **args)
