"""Rows with zero loss and gradient run forward only: the same step, metrics and token log.

``Objective.rows_without_gradient`` picks the rows (all advantages zero under a term that
declares ``zero_without_advantage``, no KL or entropy term in the loss); ``policy_update``
runs them last without a graph (``train.skip_zero_gradient_rows``). Checked here: the
declaration of every built-in term at the gradient (hypothesis), the selection rules and
their errors, and the trainer's step with the skip on against off (parameters, AdamW state,
metrics and ``tokens.jsonl`` lines), including the all-zero batch.
"""
import copy
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.aggregate import Normalizer
from trajgrad.objective import RECIPES, get_recipe
from trajgrad.rollout import collate
from trajgrad.train import tokenlog, updates
from trajgrad.train.config import build_config, load_config
from trajgrad.train.trainer import Trainer
from trajgrad.verify.policy import verify_policy

F64 = torch.float64
TOKEN = sorted(n for n, o in RECIPES.items() if o.kind == "token")
VANISHING = [n for n in TOKEN if RECIPES[n].replace(kl_placement="none", kl_coef=0.0).zero_without_advantage]


def _plain(name):
    """The recipe with its KL term out of the loss (GRPO's default has one)."""
    o = RECIPES[name]
    o = o.replace(kl_placement="none", kl_coef=0.0) if o.kl_placement != "none" else o
    return o.replace(dynamic_sampling=False) if o.dynamic_sampling else o


def test_the_declaring_terms_are_the_advantage_weighted_ones():
    declared = {o.loss for o in map(_plain, TOKEN) if o.zero_without_advantage}
    assert declared == {"reinforce", "ppo", "gspo", "gspo_token", "sapo", "sao", "vespo", "cispo", "gmpo",
                        "dppo_tv", "dppo_kl"}
    # DRO's quadratic penalty acts at A = 0; Clip-Cov / KL-Cov read the batch's covariances
    assert {o.loss for o in map(_plain, TOKEN) if not o.zero_without_advantage} == {"dro", "clip_cov", "kl_cov"}


# ---------------------------------------------------------------------- the declaration, at the gradient
def _inputs(draw_seed, B, L, recipe, zero_rows):
    g = torch.Generator().manual_seed(draw_seed)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        start = int(torch.randint(0, L // 2, (1,), generator=g))
        end = int(torch.randint(start + 1, L + 1, (1,), generator=g))
        mask[b, start:end] = True
    logp = -torch.rand(B, L, generator=g, dtype=F64) * 3 - 0.01
    old = (logp + 0.3 * torch.randn(B, L, generator=g, dtype=F64)).clamp(max=-1e-6)
    if recipe.term.sequence_advantages or recipe.advantage_level != "token":
        adv = torch.randn(B, generator=g, dtype=F64)
        adv[zero_rows] = 0.0
    else:
        adv = torch.randn(B, L, generator=g, dtype=F64)
        adv[zero_rows] = 0.0
        adv = torch.where(mask, adv, torch.tensor(float("nan"), dtype=F64))  # masked slots never read
    nan = torch.tensor(float("nan"), dtype=F64)
    return torch.where(mask, logp, nan), torch.where(mask, old, nan), adv, mask


def _loss_and_grad(recipe, logp, old, adv, mask, den):
    lp = logp.clone().requires_grad_(True)
    res = recipe.policy_loss(lp, adv, mask, old_logp=old, behaviour_logp=old, denominator=den)
    (g,) = torch.autograd.grad(res.loss, lp, allow_unused=True)
    return res.loss.detach(), torch.zeros_like(lp) if g is None else g


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(VANISHING), B=st.integers(2, 6), L=st.integers(2, 12), seed=st.integers(0, 10_000),
       pattern=st.integers(1, 2**6 - 2), correction=st.sampled_from([None, "tis", "mis_bypass"]))
def test_zero_advantage_rows_have_zero_gradient_and_the_rest_alone_give_the_step(name, B, L, seed, pattern,
                                                                                  correction):
    recipe = _plain(name)
    if correction == "tis" and recipe.ratio_source != "behaviour":
        recipe = recipe.replace(rollout_correction={"kind": "tis", "level": "sequence", "cap": 1.5})
    elif correction == "mis_bypass":
        recipe = recipe.replace(rollout_correction={"kind": "mis", "level": "token", "bounds": [0.7, 1.4],
                                                    "mode": "bypass"})
    zero = torch.tensor([(pattern >> b) & 1 == 1 for b in range(B)])
    if bool(zero.all()):
        zero[0] = False
    logp, old, adv, mask = _inputs(seed, B, L, recipe, zero)
    assert torch.equal(recipe.rows_without_gradient(adv, mask), zero)
    den = Normalizer.from_masks([mask], recipe.aggregation, constant=recipe.constant).denominator()
    v, g = _loss_and_grad(recipe, logp, old, adv, mask, den)
    assert torch.isfinite(v) and torch.isfinite(g).all()
    assert bool((g[zero] == 0).all()), "a row with zero advantages got a gradient"
    keep = ~zero
    v2, g2 = _loss_and_grad(recipe, logp[keep], old[keep], adv[keep], mask[keep], den)
    assert torch.allclose(v2, v, rtol=1e-12, atol=1e-15)
    assert torch.allclose(g2, g[keep], rtol=1e-12, atol=1e-15)


def test_dro_is_not_declared_because_its_penalty_moves_zero_advantage_rows():
    recipe = _plain("dro")
    logp, old, adv, mask = _inputs(3, 4, 8, recipe, torch.tensor([True, False, True, False]))
    _, g = _loss_and_grad(recipe, logp, old, adv, mask, None)
    assert float(g[0].abs().max()) > 0  # the reason the trainer must differentiate it


@pytest.mark.parametrize("name", VANISHING)
def test_verify_checks_the_declaration_of_every_declaring_recipe(name):
    recipe = _plain(name)

    def own(logp, old_logp, advantages, mask, denominator=None):
        return recipe.policy_loss(logp, advantages, mask, old_logp=old_logp, behaviour_logp=old_logp,
                                  denominator=denominator)

    rep = verify_policy(own, recipe)
    (check,) = [c for c in rep.checks if c.name == "zero_rows"]
    assert check.passed, rep.table()


def test_verify_catches_a_term_that_moves_zero_advantage_rows():
    recipe = _plain("ppo")

    def leaky(logp, old_logp, advantages, mask, denominator=None):
        base = recipe.policy_loss(logp, advantages, mask, old_logp=old_logp, denominator=denominator).loss
        z = torch.where(mask.bool(), logp - old_logp, 0.0)
        den = mask.sum() if denominator is None else denominator
        return base + 1e-3 * (z * z).sum() / den  # a penalty that acts at A = 0 (DRO's kind)

    def coupled(logp, old_logp, advantages, mask, denominator=None):
        m = mask.bool()
        centred = advantages - advantages[m].mean()  # a batch statistic over every row
        return recipe.policy_loss(logp, torch.where(m, centred, 0.0), mask, old_logp=old_logp,
                                  denominator=denominator).loss

    for bad in (leaky, coupled):
        (check,) = [c for c in verify_policy(bad, recipe).checks if c.name == "zero_rows"]
        assert not check.passed, bad.__name__


# ---------------------------------------------------------------------- the selection rules
def test_rows_without_gradient_per_response_and_per_token_advantages():
    o = _plain("dr_grpo")
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    seq = torch.tensor([0.0, 0.5, 0.7, 0.0], dtype=F64)
    # row 2 has no action token: nothing to differentiate whatever its advantage
    assert o.rows_without_gradient(seq, mask).tolist() == [True, False, True, True]
    nan = float("nan")
    tok = torch.tensor([[nan, 0.0, 0.0], [7.0, 0.0, nan], [1.0, 1.0, 1.0], [0.0, nan, 0.0]], dtype=F64)
    # NaN off the actions is not read; row 1's 7.0 sits at a masked slot; a NaN at an action keeps row 3
    assert _plain("ppo").rows_without_gradient(tok, mask).tolist() == \
        [True, True, True, False]


def test_rows_without_gradient_is_none_when_another_term_moves_the_row():
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.zeros(2, dtype=F64)
    assert get_recipe("grpo", kl_placement="loss", kl_coef=0.04).rows_without_gradient(adv, mask) is None
    assert _plain("grpo").replace(entropy_coef=0.01).rows_without_gradient(adv, mask) is None
    assert _plain("grpo").replace(entropy_target=0.5).rows_without_gradient(adv, mask) is None
    assert _plain("dro").rows_without_gradient(adv, mask) is None
    assert _plain("grpo").replace(kl_placement="reward", kl_coef=0.1).rows_without_gradient(adv, mask).all()


def test_rows_without_gradient_rejects_bad_shapes_by_name():
    o = _plain("grpo")
    with pytest.raises(ValueError, match="advantages"):
        o.rows_without_gradient(torch.zeros(3, dtype=F64), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="advantages"):
        o.rows_without_gradient(torch.zeros(2, 5, dtype=F64), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        o.rows_without_gradient(torch.zeros(2, dtype=F64), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        o.rows_without_gradient(torch.zeros(2, dtype=F64), torch.full((2, 4), 2.0))


def test_the_config_switch_is_refused_where_it_changes_nothing():
    # (the CLI's one-line error for it is a case of tests/test_config_errors.py)
    on = {"recipe.name": "dr_grpo", "train.skip_zero_gradient_rows": False}
    assert load_config(preset="tiny", overrides=on).train.skip_zero_gradient_rows is False
    with pytest.raises(ValueError, match="train.skip_zero_gradient_rows"):
        load_config(preset="tiny", overrides={**on, "recipe.name": "dro"})


# ---------------------------------------------------------------------- the trainer's step, on against off
def _trainer(tmp_path, **train):
    data = {
        "name": "forward-only",
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 2, "heads": 2}},
        "task": {"name": "calculator", "n_train": 64, "n_heldout": 4,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 2, "min_ops": 1, "max_ops": 1,
                             "max_operand": 9}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "recipe": {"name": "dr_grpo"},
        "optim": {"grad_clip": None, "weight_decay": 0.1},
        "train": {"steps": 1, "prompts_per_step": 4, "group_size": 2, "micro_batch_size": 3, **train},
        "sft": {"steps": 0}, "eval": {"before": False, "after": False, "every": 0}, "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": False, "token_log": True},
    }
    torch.manual_seed(0)
    return Trainer(build_config(data), tmp_path, console=lambda *_: None)


def _step(tr, batch, adv, skip):
    """One policy update from the same weights and optimizer state, with its token-log lines."""
    st = tr.learner
    st.skip_zero_gradient_rows = skip
    calls = []
    real = updates.logprobs

    def spy(s, mb, **kw):
        calls.append((len(mb), torch.is_grad_enabled()))
        return real(s, mb, **kw)

    updates.logprobs = spy
    try:
        rec = tokenlog.StepRecord(batch, step=1, learner_version=0)
        token = tokenlog._ACTIVE.set(rec)
        try:
            m = updates.policy_update(st, batch, adv, None, None, behaviour=batch.old_logp.double(),
                                      behaviour_logp=torch.where(batch.action_mask, batch.old_logp.double(), 0.0))
        finally:
            tokenlog._ACTIVE.reset(token)
    finally:
        updates.logprobs = real
    params = {n: p.detach().clone() for n, p in st.model.named_parameters() if p.requires_grad}
    moments = {n: {k: v.clone() for k, v in st.optimizer.state[p].items() if torch.is_tensor(v)}
               for n, p in st.model.named_parameters() if p in st.optimizer.state}
    return m, params, moments, [json.loads(line) for line in rec.lines(1)], calls


def _compare(tr, batch, adv):
    st = tr.learner
    model0, opt0 = copy.deepcopy(st.model.state_dict()), copy.deepcopy(st.optimizer.state_dict())
    out = {}
    for skip in (False, True):
        st.model.load_state_dict(model0)
        st.optimizer.load_state_dict(opt0)
        out[skip] = _step(tr, batch, adv, skip)
    (m0, p0, s0, l0, c0), (m1, p1, s1, l1, c1) = out[False], out[True]
    # the gradients, through AdamW's first moment ((1 - beta1) g after this first step), agree tightly
    assert s0.keys() == s1.keys() == p0.keys()
    assert all(torch.allclose(s0[n][k], s1[n][k], rtol=1e-5, atol=1e-9) for n in s0 for k in s0[n])
    lr = st.optimizer.param_groups[0]["lr"]
    for n in p0:
        assert not torch.equal(p0[n], model0[n]), n  # the step moved every parameter (weight decay at least)
        # AdamW's first step is lr g / (|g| + eps): where |g| is far above eps the parameters agree
        # tightly; for a near-zero gradient the float32 rounding of differently batched rows is
        # amplified up to a whole step of either sign, so there the bound is that step
        well = s0[n]["exp_avg"].abs() > 1e-7                # |g| > 1e-6
        assert torch.allclose(p0[n][well], p1[n][well], rtol=1e-5, atol=1e-7), n
        assert float((p0[n] - p1[n]).abs().max()) <= 2.0 * lr * 1.001, n
    # "tokens" is each micro-batch's token count averaged over micro-batches: it follows the split
    bad = {k: (m0[k], m1[k]) for k in m0 if k not in ("update/forward_only_frac", "tokens") and math.isfinite(m0[k])
           and m1[k] != pytest.approx(m0[k], rel=1e-5, abs=1e-7)}
    assert not bad
    assert len(l0) == len(l1)
    for a, b in zip(l0, l1):
        assert a.keys() == b.keys() and a["episode_id"] == b["episode_id"]
        for k in ("adv", "zero_grad"):
            assert a[k] == b[k], k
        for k in ("logp", "old", "ratio", "grad", "entropy"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    return m0, m1, c0, c1


def test_the_step_with_forward_only_rows_is_the_step_that_differentiates_them(tmp_path):
    tr = _trainer(tmp_path / "run")
    trajs, _ = tr._collect()
    batch = collate(trajs, tr.pad_id)
    B = len(batch)
    # groups of two: rows 0-1 and 4-5 carry a signal, 2-3 and 6-7 have one reward each (zero advantages)
    adv = torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0], dtype=F64)[:B]
    assert B == 8
    m0, m1, c0, c1 = _compare(tr, batch, adv)
    assert m0["update/forward_only_frac"] == 0.0 and m1["update/forward_only_frac"] == 0.5
    # off: three differentiated micro-batches of 3, 3, 2 rows; on: 4 rows differentiated, 4 forward only
    assert c0 == [(3, True), (3, True), (2, True)]
    assert c1 == [(3, True), (1, True), (3, False), (1, False)]
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-6)


def test_a_batch_without_any_signal_is_differentiated_so_adamw_sees_zero_gradients(tmp_path):
    tr = _trainer(tmp_path / "run")
    trajs, _ = tr._collect()
    batch = collate(trajs, tr.pad_id)
    adv = torch.zeros(len(batch), dtype=F64)
    # with no gradient at all AdamW would skip its weight decay and moment updates; zero gradients do not
    m0, m1, c0, c1 = _compare(tr, batch, adv)
    assert m1["update/forward_only_frac"] == 0.0 and all(g for _, g in c1)


def test_the_switch_reaches_the_learner(tmp_path):
    assert _trainer(tmp_path / "a").learner.skip_zero_gradient_rows is True
    assert _trainer(tmp_path / "b", skip_zero_gradient_rows=False).learner.skip_zero_gradient_rows is False
