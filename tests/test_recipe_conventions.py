"""The published conventions as recipe fields: each one a ``recipe.overrides.<field>`` that reaches the core
function's argument (the recipe's value equals the function's with that argument), that ``explain`` prints,
``explain --diff`` names and a bad value refuses with one line naming the field; the rollout correction's
sequence mask measured against the current policy in decoupled mode, and its advantage level required at load
time where the advantages vary within a response."""
import math
from types import SimpleNamespace

import pytest
import torch

from trajgrad.advantages import maxrl_advantages, reinforce_pp_advantages, token_skip_observation_gae, whiten
from trajgrad.logprobs.correction import rollout_correction
from trajgrad.losses import clip_cov_loss, gmpo_loss, kl_cov_loss, ppo_clip_loss
from trajgrad.objective import explain, explain_diff, get_recipe
from trajgrad.train.updates import correction_metrics
from trajgrad.verify import verify

D64 = torch.float64


def _batch(seed=0, B=6, L=7, noise=0.4, per_row=True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 3
    old = logp + noise * torch.randn(B, L, generator=g, dtype=D64)
    mask = torch.rand(B, L, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=D64)
    adv = adv[:, None].expand(B, L).clone() if per_row else torch.randn(B, L, generator=g, dtype=D64)
    return logp, old, adv, mask.to(D64)


def _recipe_loss(o, logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    res = o.policy_loss(lp, adv, mask, old_logp=old, **kw)
    res.loss.backward()
    return res.loss.detach(), lp.grad


def _core_loss(fn, logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    res = fn(lp, old, adv, mask, **kw)
    res.loss.backward()
    return res.loss.detach(), lp.grad


def _same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _differs(a, b):
    assert not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))


def _diff_names(recipe, o, *fields):
    diff = explain_diff(recipe, o)
    head = diff.split("\n\n")[1]  # the block "fields that differ"
    for f in fields:
        assert f"  {f} " in head, (f, diff)


# ---------------------------------------------------------------------- GMPO
def test_gmpo_clip_level_reaches_gmpo_loss_and_is_printed():
    logp, old, adv, mask = _batch(1, noise=0.5)
    o = get_recipe("gmpo", gmpo_clip_level="sequence")
    assert get_recipe("gmpo").gmpo_clip_level == "token"
    got = _recipe_loss(o, logp, old, adv, mask)
    _same(got, _core_loss(gmpo_loss, logp, old, adv, mask, clip_low=0.4, clip_high=0.4, clip_level="sequence",
                          aggregation=o.aggregation))
    _differs(got, _recipe_loss(get_recipe("gmpo"), logp, old, adv, mask))
    text = explain(o)
    assert "sequence-level clip of the mean log ratio" in text and "z̄_i" in text
    assert "token-level clip in log space" in explain("gmpo")
    _diff_names("gmpo", o, "gmpo_clip_level")
    with pytest.raises(ValueError, match="^gmpo_clip_level: must be one of"):
        get_recipe("gmpo", gmpo_clip_level="response")
    with pytest.raises(ValueError, match="^gmpo_clip_level: has no effect"):
        get_recipe("grpo", gmpo_clip_level="sequence")


def test_gmpo_clip_level_verify_tells_sequence_from_token_clipping():
    o = get_recipe("gmpo", gmpo_clip_level="sequence")

    def seq(logp, old_logp, advantages, mask, denominator=None):
        return gmpo_loss(logp, old_logp, advantages, mask, clip_level="sequence", denominator=denominator)

    def tok(logp, old_logp, advantages, mask, denominator=None):
        return gmpo_loss(logp, old_logp, advantages, mask, denominator=denominator)

    assert verify(seq, o).passed
    assert not verify(tok, o).passed


# ---------------------------------------------------------------------- Clip-Cov
def _cov_batch():
    """Two one-token rows with Cov = (±1)(±1) = 1 exactly (the window's lower bound), ratio 1."""
    logp = torch.tensor([[-0.5], [-2.5]], dtype=D64)
    return logp, logp.clone(), torch.tensor([1.0, -1.0], dtype=D64), torch.ones(2, 1, dtype=D64)


def test_clip_cov_band_reaches_the_loss():
    logp, old, adv, mask = _cov_batch()
    o = get_recipe("clip_cov", cov_band="closed", cov_ratio=1.0)
    got = _recipe_loss(o, logp, old, adv, mask)
    # every candidate is selected at cov_ratio 1, so the random draw (its seed) plays no part
    _same(got, _core_loss(clip_cov_loss, logp, old, adv, mask, clip_ratio=1.0, cov_band="closed", eps_low=0.2,
                          eps_high=0.2))
    assert torch.equal(got[1], torch.zeros_like(logp))  # both tokens on the closed band's edge: detached
    open_ = _recipe_loss(get_recipe("clip_cov", cov_ratio=1.0), logp, old, adv, mask)
    assert (open_[1] != 0).all()  # the open band has no candidate
    assert "1 ≤ Cov ≤ 5 (closed band)" in explain(o)
    assert "1 < Cov < 5" in explain("clip_cov")
    _diff_names("clip_cov", o, "cov_band")
    with pytest.raises(ValueError, match="^cov_band: must be one of"):
        get_recipe("clip_cov", cov_band="half")


# every token a candidate and every candidate selected: the random draw plays no part. A PPO-clipped token has no
# gradient and sg[s] = s, so detaching it changes nothing: cov_exclude_clipped shows with selected terms zeroed.
@pytest.mark.parametrize("field,value,arg,setting", [
    ("cov_selected", "zero", dict(selected="zero"), {}),
    ("cov_exclude_clipped", False, dict(exclude_clipped=False, selected="zero"), dict(cov_selected="zero")),
])
def test_clip_cov_selection_options_reach_the_loss(field, value, arg, setting):
    logp, old, adv, mask = _batch(2, noise=0.5)
    setting = dict(cov_low=-100.0, cov_ratio=1.0, **setting)
    o = get_recipe("clip_cov", **setting, **{field: value})
    base = get_recipe("clip_cov", **setting)
    got = _recipe_loss(o, logp, old, adv, mask)
    _same(got, _core_loss(clip_cov_loss, logp, old, adv, mask, clip_ratio=1.0, cov_low=-100.0, eps_low=0.2,
                          eps_high=0.2, **arg))
    _differs(got, _recipe_loss(base, logp, old, adv, mask))
    _diff_names(base, o, field)
    if field == "cov_selected":
        assert "times 0 on the tokens of S" in explain(o)
        assert "the selected tokens' terms" not in explain(o).split("detached (stop-gradient):")[1]
        with pytest.raises(ValueError, match="^cov_selected: must be one of"):
            get_recipe("clip_cov", cov_selected="drop")
    else:
        assert "PPO-clipped tokens included" in explain(o) and "not clipped by PPO" in explain(base)
        with pytest.raises(ValueError, match="^cov_exclude_clipped: must be True or False"):
            get_recipe("clip_cov", cov_exclude_clipped=1)


def test_clip_cov_selected_verify_tells_zeroed_from_detached_terms():
    setting = dict(cov_low=-100.0, cov_ratio=1.0)  # every token selected: the battery's batches select alike
    o = get_recipe("clip_cov", cov_selected="zero", **setting)

    def ref(selected):
        def fn(logp, old_logp, advantages, mask, denominator=None):
            return clip_cov_loss(logp, old_logp, advantages, mask, clip_ratio=1.0, cov_low=-100.0, selected=selected,
                                 denominator=denominator)
        return fn

    assert verify(ref("zero"), o).passed
    rep = {c.name: c for c in verify(ref("detach"), o).checks}
    assert not rep["value"].passed and rep["gradient"].passed  # same gradient (none), different value
    assert verify(ref("detach"), get_recipe("clip_cov", **setting)).passed


# ---------------------------------------------------------------------- KL-Cov
def test_kl_cov_positive_only_reaches_the_loss():
    logp, old, adv, mask = _batch(3)
    o = get_recipe("kl_cov", kl_cov_positive_only=False, cov_ratio=0.9)
    got = _recipe_loss(o, logp, old, adv, mask)
    _same(got, _core_loss(kl_cov_loss, logp, old, adv, mask, kl_ratio=0.9, kl_coef=1.0, positive_only=False))
    _differs(got, _recipe_loss(get_recipe("kl_cov", cov_ratio=0.9), logp, old, adv, mask))
    assert "tokens of largest Cov, over every valid token" in explain(o)
    assert "tokens of largest positive Cov" in explain("kl_cov")
    _diff_names("kl_cov", o, "kl_cov_positive_only")
    with pytest.raises(ValueError, match="^kl_cov_positive_only: must be True or False"):
        get_recipe("kl_cov", kl_cov_positive_only="no")


def test_kl_cov_base_reads_the_recipes_clip_range_only_when_ppo_clip():
    logp, old, adv, mask = _batch(4, noise=0.5)
    o = get_recipe("kl_cov", kl_cov_base="ppo_clip", eps_low=0.1, eps_high=0.3)
    got = _recipe_loss(o, logp, old, adv, mask)
    _same(got, _core_loss(kl_cov_loss, logp, old, adv, mask, kl_ratio=2e-3, kl_coef=1.0, base="ppo_clip",
                          eps_low=0.1, eps_high=0.3))
    _differs(got, _recipe_loss(get_recipe("kl_cov"), logp, old, adv, mask))
    # eps_high None is eps_low, as everywhere
    _same(_recipe_loss(get_recipe("kl_cov", kl_cov_base="ppo_clip"), logp, old, adv, mask),
          _core_loss(kl_cov_loss, logp, old, adv, mask, kl_ratio=2e-3, base="ppo_clip", eps_low=0.2, eps_high=0.2))
    assert "clip(ρ_it, 1 − 0.1, 1 + 0.3)" in explain(o) and "(PPO-clipped surrogate)" in explain(o)
    assert "(no clipping)" in explain("kl_cov")
    _diff_names("kl_cov", o, "kl_cov_base", "eps_low", "eps_high")
    assert "eps_low" in o.read_fields() and "eps_low" not in get_recipe("kl_cov").read_fields()
    with pytest.raises(ValueError, match="^eps_low: has no effect"):
        get_recipe("kl_cov", eps_low=0.1)
    with pytest.raises(ValueError, match="^kl_cov_base: must be one of"):
        get_recipe("kl_cov", kl_cov_base="clip")
    with pytest.raises(ValueError, match="^eps_low: must lie in"):
        get_recipe("kl_cov", kl_cov_base="ppo_clip", eps_low=1.5)


def test_kl_cov_options_verify():
    o = get_recipe("kl_cov", kl_cov_base="ppo_clip", kl_cov_positive_only=False)

    def paper(logp, old_logp, advantages, mask, denominator=None):
        return kl_cov_loss(logp, old_logp, advantages, mask, kl_ratio=2e-3, base="ppo_clip", positive_only=False,
                           eps_low=0.2, eps_high=0.2, denominator=denominator)

    def unclipped(logp, old_logp, advantages, mask, denominator=None):
        return kl_cov_loss(logp, old_logp, advantages, mask, kl_ratio=2e-3, positive_only=False,
                           denominator=denominator)

    rep = verify(paper, o)
    assert {c.name: c for c in rep.checks}["value"].passed and {c.name: c for c in rep.checks}["gradient"].passed
    bad = {c.name: c for c in verify(unclipped, o).checks}
    assert not (bad["value"].passed and bad["gradient"].passed)


# ---------------------------------------------------------------------- REINFORCE++ / GAE whitening
@pytest.mark.parametrize("recipe,baseline", [("reinforce_pp", False), ("reinforce_pp_baseline", True)])
def test_whiten_eps_placement_reaches_reinforce_pp(recipe, baseline):
    g = torch.Generator().manual_seed(5)
    base = get_recipe(recipe, std_eps=0.5)  # a visible eps
    G = base.group_size if baseline else 1
    rewards = torch.randint(0, 2, (4 * max(G, 2),), generator=g).to(D64)
    gids = torch.arange(rewards.numel()) // max(G, 2)
    o = base.replace(whiten_eps_placement="std")
    got = o.sequence_advantages(rewards, gids).advantages
    want = reinforce_pp_advantages(rewards, group_baseline=baseline, group_ids=gids, unbiased=o.std_unbiased,
                                   eps=0.5, eps_placement="std").advantages
    assert torch.equal(got, want)
    assert not torch.equal(got, base.sequence_advantages(rewards, gids).advantages)
    assert "/ (std_batch(Ã) + 0.5)" in explain(o) and "/ sqrt(var_batch(Ã) + 0.5)" in explain(base)
    _diff_names(base, o, "whiten_eps_placement")
    with pytest.raises(ValueError, match="^whiten_eps_placement: must be one of"):
        get_recipe(recipe, whiten_eps_placement="sigma")


def test_whiten_empty_zeros_for_a_batch_with_one_response():
    o = get_recipe("reinforce_pp", whiten_empty="zeros")
    assert o.std_unbiased  # the Bessel variance needs two responses
    one = torch.tensor([1.0], dtype=D64)
    with pytest.raises(ValueError):
        get_recipe("reinforce_pp").sequence_advantages(one)
    got = o.sequence_advantages(one).advantages
    assert torch.equal(got, reinforce_pp_advantages(one, unbiased=True, eps=o.std_eps, empty="zeros").advantages)
    assert torch.equal(got, torch.zeros(1, dtype=D64))
    assert "gives A = 0 (whiten_empty = 'zeros')" in explain(o) and "whiten_empty" not in explain("reinforce_pp")
    _diff_names("reinforce_pp", o, "whiten_empty")
    with pytest.raises(ValueError, match="^whiten_empty: must be one of"):
        get_recipe("reinforce_pp", whiten_empty="nan")


def test_gae_whitening_reads_the_options_only_when_it_whitens():
    g = torch.Generator().manual_seed(6)
    B, L = 4, 6
    values, rewards = torch.randn(B, L, generator=g, dtype=D64), torch.randn(B, L, generator=g, dtype=D64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 4:] = False
    o = get_recipe("ppo", whiten_advantages=True, whiten_eps_placement="std")
    got = o.token_advantages(values, rewards, mask, bootstrap_value=0.0).advantages
    raw = token_skip_observation_gae(values, rewards, mask, gamma=o.gamma, lam=o.lam, bootstrap_value=0.0).advantages
    assert torch.equal(got, whiten(raw, mask, eps_placement="std"))
    assert not torch.equal(got, get_recipe("ppo", whiten_advantages=True).token_advantages(
        values, rewards, mask, bootstrap_value=0.0).advantages)
    assert "A_t ← (A_t − μ) / (σ + 1e-8)" in explain(o)
    _diff_names(get_recipe("ppo", whiten_advantages=True), o, "whiten_eps_placement")
    assert "whiten_eps_placement" not in get_recipe("ppo").read_fields()
    with pytest.raises(ValueError, match="^whiten_eps_placement: has no effect"):
        get_recipe("ppo", whiten_eps_placement="std")
    empty = torch.zeros(B, L, dtype=torch.bool)
    z = get_recipe("ppo", whiten_advantages=True, whiten_empty="zeros").token_advantages(
        values, rewards, empty, bootstrap_value=0.0).advantages
    assert torch.equal(z, torch.zeros(B, L, dtype=D64))


# ---------------------------------------------------------------------- MaxRL
@pytest.mark.parametrize("kw,arg", [
    (dict(maxrl_eps=0.5), dict(eps=0.5)),
    (dict(maxrl_eps=0.5, maxrl_eps_mode="add"), dict(eps=0.5, eps_mode="add")),
    (dict(maxrl_centred=False), dict(centred=False)),
])
def test_maxrl_options_reach_maxrl_advantages(kw, arg):
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=D64)
    base = get_recipe("maxrl")
    o = get_recipe("maxrl", **kw)
    got = o.sequence_advantages(rewards).advantages
    assert torch.equal(got, maxrl_advantages(rewards, **arg).advantages)
    assert not torch.equal(got, base.sequence_advantages(rewards).advantages)
    _diff_names("maxrl", o, *kw)
    text = explain(o)
    if "maxrl_eps_mode" in kw:
        assert "/ (mean_G(R) + 0.5)" in text
    elif "maxrl_eps" in kw:
        assert "/ max(mean_G(R), 0.5)" in text
    else:
        assert "A_i = (R_i) / mean_G(R)" in text and "uncentred" in text


def test_maxrl_worked_example_through_the_recipe():
    r = torch.tensor([[1.0, 0, 0, 0]], dtype=D64)
    adv = lambda **kw: get_recipe("maxrl", **kw).sequence_advantages(r).advantages[0].tolist()  # noqa: E731
    assert adv(maxrl_eps=0.25) == [3.0, -1.0, -1.0, -1.0]
    assert adv(maxrl_eps=0.25, maxrl_eps_mode="add") == [1.5, -0.5, -0.5, -0.5]
    assert adv(maxrl_centred=False) == [4.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("kw,field", [(dict(maxrl_eps=-0.1), "maxrl_eps"), (dict(maxrl_eps=math.inf), "maxrl_eps"),
                                      (dict(maxrl_eps_mode="sum"), "maxrl_eps_mode"),
                                      (dict(maxrl_centred="yes"), "maxrl_centred")])
def test_maxrl_bad_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        get_recipe("maxrl", **kw)
    with pytest.raises(ValueError, match="^maxrl_eps: has no effect"):
        get_recipe("grpo", maxrl_eps=0.1)


# ---------------------------------------------------------------------- rollout correction
def _opsm(level="sequence", policy="current", **extra):
    return {"kind": "tis", "cap": 2.0, "seq_mask_delta": 0.05, "advantage_level": level, "mismatch_policy": policy,
            **extra}


def test_sequence_mask_against_the_current_policy_in_decoupled_mode():
    logp, old, adv, mask = _batch(7, per_row=False)
    g = torch.Generator().manual_seed(8)
    beh = old + 0.3 * torch.randn(old.shape, generator=g, dtype=D64).abs()
    for level in ("token", "sequence"):
        o = get_recipe("ppo", rollout_correction=_opsm(level))
        got = _recipe_loss(o, logp, old, adv, mask, behaviour_logp=beh)
        corr = rollout_correction(beh, old, mask, advantages=adv, kind="tis", cap=2.0, seq_mask_delta=0.05,
                                  advantage_level=level, mismatch_policy="current", current_logp=logp)
        assert corr.metrics["correction/seq_masked_frac"] > 0  # the mask acts on this batch
        _same(got, _core_loss(ppo_clip_loss, logp, old, adv, mask, eps_low=o.eps_low, eps_high=o.eps_high_,
                              dual_clip=o.dual_clip, weights=corr.weight, aggregation=o.aggregation))
        # measured against the proximal policy instead, the mask differs
        prox = get_recipe("ppo", rollout_correction=_opsm(level, "proximal"))
        _differs(got, _recipe_loss(prox, logp, old, adv, mask, behaviour_logp=beh))
        text = explain(o)
        assert "sequence mask: A " + {"token": "per token", "sequence": "the row's mean"}[level] in text
        assert "pi = the current policy" in text
        diff = explain_diff(prox, o)
        assert "rollout_correction" in diff.split("\n\n")[1] and "pi = the proximal policy" in diff


def test_the_step_metrics_measure_the_mask_against_the_given_current_policy():
    logp, old, adv, mask = _batch(9, per_row=False)
    beh = old + 0.2
    o = get_recipe("ppo", rollout_correction=_opsm("token"))
    batch = SimpleNamespace(action_mask=mask.bool(), turn_ids=torch.zeros(mask.shape, dtype=torch.long))
    with pytest.raises(ValueError, match="^current_logp: required"):
        correction_metrics(o, batch, beh, old, adv)
    got = correction_metrics(o, batch, beh, old, adv, current_logp=logp)
    corr = o.rollout_correction(beh, old, mask.bool(), advantages=adv, current_logp=logp)
    assert got["correction/seq_masked_frac"] == float(corr.metrics["correction/seq_masked_frac"])


@pytest.mark.parametrize("recipe,overrides", [("ppo", {}), ("grpo", dict(advantage="gae", critic=True))])
def test_sequence_mask_with_token_advantages_needs_the_level_at_load_time(recipe, overrides):
    rc = {"kind": "tis", "seq_mask_delta": 0.1}
    with pytest.raises(ValueError, match=r"^rollout_correction\.advantage_level: .*'gae'"):
        get_recipe(recipe, rollout_correction=rc, **overrides)
    assert get_recipe(recipe, rollout_correction={**rc, "advantage_level": "token"}, **overrides)
    # per-response advantages: the level is not needed (every level agrees)
    assert get_recipe("grpo", rollout_correction=rc).rollout_correction.advantage_level is None


# ---------------------------------------------------------------------- in a config (recipe.overrides.<field>)
@pytest.mark.parametrize("sets,key", [
    (["recipe.name=gmpo", "recipe.overrides.gmpo_clip_level=bogus"], "recipe.overrides.gmpo_clip_level"),
    (["recipe.name=clip_cov", "recipe.overrides.cov_selected=drop"], "recipe.overrides.cov_selected"),
    (["recipe.name=kl_cov", "recipe.overrides.eps_low=0.1"], "recipe.overrides.eps_low"),
    (["recipe.name=maxrl", "recipe.overrides.maxrl_eps_mode=sum"], "recipe.overrides.maxrl_eps_mode"),
    (["recipe.name=reinforce_pp", "recipe.overrides.whiten_empty=nan"], "recipe.overrides.whiten_empty"),
    (["recipe.name=ppo", "recipe.overrides.rollout_correction.kind=tis",
      "recipe.overrides.rollout_correction.seq_mask_delta=0.1"], "recipe.overrides.rollout_correction.advantage_level"),
])
def test_a_bad_option_in_a_config_is_one_line_naming_the_key(tmp_path, monkeypatch, sets, key):
    from typer.testing import CliRunner

    from trajgrad.cli import app

    monkeypatch.chdir(tmp_path)
    argv = ["train", "--preset", "tiny"] + [a for s in sets for a in ("--set", s)]
    res = CliRunner().invoke(app, argv)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith(f"error: {key}: "), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_a_decoupled_update_measures_the_sequence_mask_against_the_current_policy(tmp_path):
    """Through the trainer's update: two epochs against the recomputed π_old; the step's mask fraction is that of
    the first epoch's π_θ (the weights before the step, which the recompute equals here)."""
    from test_correction_train import _reference, decoupled_step

    from trajgrad.train import updates

    st, batch, adv, old, beh = decoupled_step(tmp_path)
    mask = batch.action_mask
    rc = {"kind": "tis", "cap": 1.5, "seq_mask_delta": 0.0, "mismatch_policy": "current"}
    st.objective = st.objective.replace(rollout_correction=rc)
    m = updates.policy_update(st, batch, adv, old, _reference(st, batch), behaviour_logp=beh)
    want = rollout_correction(beh, old, mask, advantages=adv, kind="tis", cap=1.5, seq_mask_delta=0.0,
                              mismatch_policy="current", current_logp=old)
    assert m["correction/seq_masked_frac"] == pytest.approx(float(want.metrics["correction/seq_masked_frac"]), abs=1e-6)
    assert math.isfinite(m["loss"])
