"""Check once, at the boundary: one :meth:`Objective.policy_loss` reads the mask's values once.

Every mask check enters :func:`trajgrad._checks.as_tensor` with the name ``"mask"``
(``check_mask`` and the losses' ``_as_mask`` both do), so a counting wrapper on it sees each
one. A check of a non-bool mask reads its values (is it 0/1?): a pass over the tensor and a
device sync. ``policy_loss`` checks a mask that more than the term reads (rollout correction,
KL in the loss, entropy bonus) once and hands the bool result on; a bool mask is only
shape-checked by the functions it is handed to. The public functions keep their own checks.
"""
import collections

import pytest
import torch

from trajgrad import _checks
from trajgrad.aggregate import aggregate
from trajgrad.objective import Objective, RECIPES
from trajgrad.train import updates
from trajgrad.train.trainer import Trainer

from test_train import micro_config

B, L = 4, 6
TOKEN_RECIPES = sorted(n for n, o in RECIPES.items() if o.kind == "token")


class MaskChecks:
    """Counts the mask checks (``entries``) and those of a non-bool mask (``reads``, value passes)."""

    def __init__(self, monkeypatch):
        self.entries = self.reads = 0
        self.active = True
        real = _checks.as_tensor

        def counting(name, x, **kw):
            if name == "mask" and self.active:
                self.entries += 1
                self.reads += not (isinstance(x, torch.Tensor) and x.dtype == torch.bool)
            return real(name, x, **kw)

        monkeypatch.setattr(_checks, "as_tensor", counting)


def _batch(obj, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, L, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, generator=g) if obj.term.sequence_advantages else torch.randn(B, L, generator=g)
    mask = (torch.rand(B, L, generator=g) > 0.3).double()  # a float 0/1 mask: its check reads the values
    mask[:, 0] = 1
    ent = torch.rand(B, L, generator=g, dtype=torch.float64).requires_grad_()
    return logp.double().detach().requires_grad_(), adv.double(), mask, dict(
        old_logp=old.double(), behaviour_logp=old.double(), ref_logp=old.double() - 0.05, entropy=ent)


@pytest.mark.parametrize("recipe", TOKEN_RECIPES)
def test_policy_loss_checks_the_mask_once(recipe, monkeypatch):
    obj = RECIPES[recipe]
    logp, adv, mask, kw = _batch(obj)
    count = MaskChecks(monkeypatch)
    obj.policy_loss(logp, adv, mask, **kw)
    assert count.reads == 1, f"{recipe}: the mask's values were read {count.reads} times"
    if recipe in ("ppo", "grpo"):
        assert count.entries == 1


# recipes whose mask is read by more than the term; before: correction + term = 2 reads, KL estimate +
# 2 aggregations + term = 4, KL estimate + aggregation + term = 3. Now one read in policy_loss, and the
# bool mask it hands on is shape-checked (not read) by the correction, the KL estimate and the term.
EXTRA_READERS = {
    "ppo+correction": (RECIPES["ppo"].replace(rollout_correction={"kind": "tis", "cap": 1.3}), 3),
    "ppo+kl+entropy": (RECIPES["ppo"].replace(kl_placement="loss", kl_coef=0.1, entropy_coef=0.01), 3),
    "verl-grpo": (RECIPES["verl-grpo"], 3),
}


@pytest.mark.parametrize("case", sorted(EXTRA_READERS))
def test_a_mask_with_several_readers_is_read_once(case, monkeypatch):
    obj, entries = EXTRA_READERS[case]
    logp, adv, mask, kw = _batch(obj)
    count = MaskChecks(monkeypatch)
    res = obj.policy_loss(logp, adv, mask, **kw)
    assert (count.reads, count.entries) == (1, entries)
    # the same loss from a bool mask (nothing to read): bit-identical
    count.active = False
    again = obj.policy_loss(logp, adv, mask.bool(), **kw)
    assert torch.equal(res.loss, again.loss)


def test_the_boundary_still_refuses_a_bad_mask_and_a_bad_entropy():
    obj = RECIPES["ppo"].replace(kl_placement="loss", kl_coef=0.1, entropy_coef=0.01)
    logp, adv, mask, kw = _batch(obj)
    bad = mask.clone()
    bad[0, 0] = 0.5
    with pytest.raises(ValueError, match=r"^mask: must contain only 0 and 1, found 0.5"):
        obj.policy_loss(logp, adv, bad, **kw)
    with pytest.raises(ValueError, match=r"^mask: expected shape"):
        obj.policy_loss(logp, adv, mask[:, :-1], **kw)
    ent = kw["entropy"].detach().clone()
    ent[0, 0] = float("nan")  # a valid position (mask[:, 0] = 1)
    with pytest.raises(ValueError, match=r"^entropy: contains NaN or inf at a valid"):
        obj.policy_loss(logp, adv, mask, **{**kw, "entropy": ent})
    with pytest.raises(ValueError, match=r"^entropy: expected a floating-point"):
        obj.policy_loss(logp, adv, mask, **{**kw, "entropy": torch.ones(B, L, dtype=torch.long)})
    # NaN at masked positions of every input still changes nothing
    poisoned = {k: torch.where(mask.bool(), v.detach(), torch.tensor(float("nan"), dtype=v.dtype)) for k, v in kw.items()}
    poisoned["entropy"].requires_grad_()
    lp = torch.where(mask.bool(), logp.detach(), torch.tensor(float("-inf"), dtype=logp.dtype)).requires_grad_()
    clean = obj.policy_loss(logp, adv, mask, **kw).loss
    dirty = obj.policy_loss(lp, torch.where(mask.bool(), adv, torch.nan), mask, **poisoned).loss
    assert torch.isfinite(dirty) and torch.equal(clean, dirty)
    dirty.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask.bool()] == 0).all()


def test_the_public_aggregate_keeps_its_checks():
    with pytest.raises(ValueError, match=r"^mask: must contain only 0 and 1"):
        aggregate(torch.ones(2, 3), torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match=r"^per_token: contains NaN or inf at a valid"):
        aggregate(torch.tensor([[float("nan"), 1.0]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"^constant: only used by mode"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), "token_mean", constant=2.0)


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_a_trainer_policy_step_checks_the_mask_once_per_loss(recipe, tmp_path, monkeypatch):
    torch.manual_seed(0)
    tr = Trainer(micro_config(recipe), tmp_path / "run", console=lambda *_: None)
    trajs, _ = tr._collect()
    count = MaskChecks(monkeypatch)
    count.active = False
    losses = collections.Counter()
    real_loss, real_step = Objective.policy_loss, updates.policy_step

    def policy_loss(self, *a, **kw):
        losses["calls"] += 1
        count.active = True
        try:
            return real_loss(self, *a, **kw)
        finally:
            count.active = False

    def policy_step(*a, **kw):
        monkeypatch.setattr(Objective, "policy_loss", policy_loss)
        try:
            return real_step(*a, **kw)
        finally:
            monkeypatch.setattr(Objective, "policy_loss", real_loss)

    monkeypatch.setattr(updates, "policy_step", policy_step)
    tr.learn(trajs)
    assert losses["calls"] >= 1
    # the trainer's mask is bool: checked for its shape once per loss, its values never re-read
    assert (count.entries, count.reads) == (losses["calls"], 0)
