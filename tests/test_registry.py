"""The recipe registry: printed = optimized, user-registered terms, explain --diff."""
import dataclasses
import math

import pytest
import torch

from trajgrad import losses
from trajgrad.aggregate import aggregate
from trajgrad.logprobs import entropy as token_entropy
from trajgrad.logprobs import token_logprobs
from trajgrad.objective import (
    RECIPES,
    SCHEDULE_FIELDS,
    Objective,
    explain,
    explain_diff,
    get_recipe,
)
from trajgrad.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_TERMS,
    AdvantageEstimator,
    PolicyTerm,
    register_advantage_estimator,
    register_policy_term,
)
from trajgrad.verify import verify

F64 = torch.float64
B, L, V = 16, 7, 5
NUMERIC = [f.name for f in dataclasses.fields(Objective)
           if f.name not in ("name", "loss", "advantage", "aggregation", "kl_placement", "kl_kind", "ratio_gradient",
                             "dynamic_sampling", "critic", "paper")]


def _data(o: Objective, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g, dtype=F64)
    targets = torch.randint(0, V, (B, L), generator=g)
    mask = (torch.rand(B, L, generator=g) > 0.25)
    mask[:, 1] = True
    lp = token_logprobs(logits, targets)
    noise = o.term.verify_noise
    return {
        "logits": logits, "targets": targets, "mask": mask,
        "old": lp + noise * torch.randn(B, L, generator=g, dtype=F64),
        "ref": lp + 0.3 * torch.randn(B, L, generator=g, dtype=F64),
        "seq_r": torch.randint(0, 3, (B,), generator=g).to(F64) + 0.1 * torch.randn(B, generator=g, dtype=F64),
        "tok_r": torch.where(torch.rand(B, L, generator=g) > 0.7, torch.randn(B, L, generator=g, dtype=F64), 0.0),
        "values": torch.randn(B, L, generator=g, dtype=F64),
        "new_values": torch.randn(B, L, generator=g, dtype=F64),
    }


def _end_to_end(o: Objective, d):
    """Advantages from rewards (KL in the reward when placed there), the loss, its gradient;
    for critic recipes also the critic's loss and gradient."""
    logits = d["logits"].clone().requires_grad_(True)
    logp = token_logprobs(logits, d["targets"])
    ent = token_entropy(logits)
    mask = d["mask"]
    kl_r = o.kl_in_reward(logp, d["ref"], mask)
    out = []
    if o.advantage_level == "sequence":
        gids = torch.arange(B) // o.group_size
        adv = o.sequence_advantages(d["seq_r"] - torch.where(mask, kl_r, 0.0).sum(1), group_ids=gids).advantages
        adv = adv[:, None].expand(B, L)
    else:
        ta = o.token_advantages(d["values"], d["tok_r"] - kl_r, mask, bootstrap_value=0.0)
        adv, ret = ta.advantages, ta.returns
    res = o.policy_loss(logp, adv, mask, old_logp=d["old"], behaviour_logp=d["old"], ref_logp=d["ref"], entropy=ent)
    (gl,) = torch.autograd.grad(res.loss, logits)
    out += [res.loss.detach(), gl]
    if o.critic:
        nv = d["new_values"].clone().requires_grad_(True)
        vl = o.value_loss(nv, ret, mask, old_values=d["values"])
        (gv,) = torch.autograd.grad(vl.loss, nv)
        out += [vl.loss.detach(), gv]
    return out


def _perturbed(field: str, value):
    if field == "dual_clip" and value is not None:
        return 1.0 + (value - 1.0) / 10  # within reach of the random batches' ratios
    if value is None:
        return {"eps_high": 0.5, "dual_clip": 1.5, "constant": 3.0, "value_clip": 0.05, "dppo_ratio_cap": 1.2,
                "entropy_target": 0.5}.get(field, 0.2)  # an optional bound switched on
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 if value > 1 else 2
    if field == "maxrl_eps":
        return 5.0  # above the random batches' group means, so that max(mean, eps) takes it
    if field in ("gamma", "lam"):
        return value * 0.7
    if field == "eps_low" and value * 3 >= 1:
        return value * 0.5
    if field == "eps_high" and value > 1:
        return value * 0.2
    return value * 3 if value else 0.1


TOKEN_RECIPES = [n for n, o in RECIPES.items() if o.kind == "token"]
# fields whose effect needs more of the batch than the recipe's default setting reaches, compared on both sides
# with this setting (Clip-Cov: a PPO-clipped candidate changes the loss only by displacing an unclipped one from
# the selection, so every token must be a candidate and the selection a sizable share; KL-Cov: the top-k reaches
# tokens of non-positive covariance only when it is larger than their count)
_SETTING_FOR = {"cov_exclude_clipped": dict(cov_low=-100.0, cov_ratio=0.3), "kl_cov_positive_only": dict(cov_ratio=0.9)}


@pytest.mark.parametrize("name", TOKEN_RECIPES)
def test_printed_iff_optimized(name):
    """For every numeric field: perturbing it changes the loss (or a gradient, or the critic's
    loss) if and only if it changes the explain text; a field the recipe does not read cannot be
    set at all."""
    base = RECIPES[name]
    d = _data(base)
    base_out, base_text = _end_to_end(base, d), explain(base)
    checked = 0
    for field in NUMERIC:
        if field in SCHEDULE_FIELDS:
            continue
        new_value = _perturbed(field, getattr(base, field))
        if field in _SETTING_FOR and field in base.read_fields():
            b = base.replace(**_SETTING_FOR[field])
            ref_out, ref_text = _end_to_end(b, d), explain(b)
        else:
            b = base
            ref_out, ref_text = base_out, base_text
        try:
            o = b.replace(**{field: new_value})
        except ValueError as exc:
            assert field in str(exc)
            assert field not in base.read_fields() or "must" in str(exc), (field, str(exc))
            continue
        out = _end_to_end(o, d)
        loss_changed = any(not torch.equal(a, b) for a, b in zip(out, ref_out)) or len(out) != len(ref_out)
        text_changed = explain(o) != ref_text
        assert loss_changed == text_changed, (name, field, new_value, loss_changed, text_changed)
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("name", list(RECIPES))
def test_schedule_fields_are_printed(name):
    base = RECIPES[name]
    for field in SCHEDULE_FIELDS:
        try:
            o = base.replace(**{field: _perturbed(field, getattr(base, field))})
        except ValueError as exc:
            assert field in str(exc)
            continue
        assert explain(o) != explain(base), (name, field)


def test_every_read_field_of_every_recipe_is_settable():
    for name, o in RECIPES.items():
        for field in o.read_fields():
            o.replace(**{field: getattr(o, field)})  # setting a read field to its own value is always accepted


def test_fields_that_change_nothing_are_refused():
    with pytest.raises(ValueError, match="tau_pos: has no effect"):
        get_recipe("grpo", tau_pos=2.0)
    with pytest.raises(ValueError, match="gamma: has no effect"):
        get_recipe("grpo", gamma=0.9)
    with pytest.raises(ValueError, match="kl_kind: has no effect"):
        get_recipe("dapo", kl_kind="k3")
    with pytest.raises(ValueError, match="value_clip: has no effect"):
        get_recipe("grpo", value_clip=0.2)
    with pytest.raises(ValueError, match="critic"):
        get_recipe("grpo", critic=True)
    with pytest.raises(ValueError, match="eps_low"):
        get_recipe("grpo", eps_low=5.0)
    with pytest.raises(ValueError, match="kl_placement"):
        get_recipe("opd", kl_placement="loss", kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef"):
        get_recipe("dpo", entropy_coef=0.01)
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match="kl_coef"):
            get_recipe("grpo", kl_coef=bad)


def test_entropy_bonus_value_and_gradient():
    o = get_recipe("grpo", entropy_coef=0.02, kl_placement="loss", kl_coef=0.04)
    d = _data(o, seed=4)
    logits = d["logits"].clone().requires_grad_(True)
    logp, ent = token_logprobs(logits, d["targets"]), token_entropy(logits)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(1), dtype=F64)[:, None].expand(B, L)
    res = o.policy_loss(logp, adv, d["mask"], old_logp=d["old"], ref_logp=d["ref"], entropy=ent)
    logits2 = d["logits"].clone().requires_grad_(True)
    lp2 = token_logprobs(logits2, d["targets"])
    manual = (losses.ppo_clip_loss(lp2, d["old"], adv, d["mask"], eps_low=0.2, aggregation="seq_mean_token_mean").loss
              + 0.04 * aggregate(losses.kl_estimate(lp2, d["ref"], d["mask"], kind="k3"), d["mask"], "seq_mean_token_mean")
              - 0.02 * aggregate(token_entropy(logits2), d["mask"], "seq_mean_token_mean"))
    assert torch.allclose(res.loss, manual, atol=1e-12)
    (g1,), (g2,) = torch.autograd.grad(res.loss, logits), torch.autograd.grad(manual, logits2)
    assert torch.allclose(g1, g2, atol=1e-12)
    # the bonus moves the gradient: without it the gradients differ
    logits3 = d["logits"].clone().requires_grad_(True)
    res0 = o.replace(entropy_coef=0.0).policy_loss(token_logprobs(logits3, d["targets"]), adv, d["mask"], old_logp=d["old"],
                                              ref_logp=d["ref"])
    (g3,) = torch.autograd.grad(res0.loss, logits3)
    assert not torch.allclose(g1, g3)
    assert "entropy bonus: − 0.02" in explain(o)
    assert float(res.metrics["entropy_bonus_term"]) > 0


def test_entropy_bonus_needs_entropy_and_ignores_masked_nan():
    o = get_recipe("dapo", entropy_coef=0.1)
    d = _data(o)
    lp = token_logprobs(d["logits"], d["targets"])
    adv = torch.ones(B, L, dtype=F64)
    with pytest.raises(ValueError, match="entropy"):
        o.policy_loss(lp, adv, d["mask"], old_logp=d["old"])
    ent = token_entropy(d["logits"]).clone().requires_grad_(True)
    poisoned = torch.where(d["mask"], ent, torch.tensor(float("nan"), dtype=F64))
    res = o.policy_loss(lp, adv, d["mask"], old_logp=d["old"], entropy=poisoned)
    (g,) = torch.autograd.grad(res.loss, ent)
    assert torch.isfinite(res.loss) and torch.isfinite(g).all()
    assert (g[~d["mask"]] == 0).all()
    with pytest.raises(ValueError, match="entropy"):
        o.policy_loss(lp, adv, d["mask"], old_logp=d["old"], entropy=ent[:, :-1])


def test_ratio_source_is_declared_by_the_term():
    d = _data(RECIPES["sao"])
    lp = token_logprobs(d["logits"], d["targets"])
    adv = torch.randn(B, L, dtype=F64, generator=torch.Generator().manual_seed(2))
    sao = RECIPES["sao"]
    assert sao.ratio_source == "behaviour" and RECIPES["ppo"].ratio_source == "old"
    assert RECIPES["reinforce"].ratio_source == "none" and not RECIPES["reinforce"].uses_old_logp
    behaviour, old = d["old"], d["ref"]
    a = sao.policy_loss(lp, adv, d["mask"], old_logp=old, behaviour_logp=behaviour).loss
    b = losses.sao_dis_loss(lp, behaviour, adv, d["mask"], eps_low=0.3, eps_high=5.0).loss
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="old_logp"):
        RECIPES["ppo"].policy_loss(lp, adv, d["mask"], behaviour_logp=behaviour)
    with pytest.raises(ValueError, match="behaviour_logp"):
        sao.policy_loss(lp, adv, d["mask"])


def _my_pg_loss(logp, advantages, mask, *, scale=1.0, aggregation="token_mean", constant=None, denominator=None):
    """A user's loss: − scale · A · log π (token level)."""
    adv = torch.where(mask.bool(), advantages.detach(), 0.0)
    x = torch.where(mask.bool(), -scale * adv * logp, 0.0)
    return losses.LossResult(aggregate(x, mask, aggregation, constant=constant, denominator=denominator), {})


def test_a_user_registered_term_and_estimator_are_covered_everywhere():
    name = "test_scaled_pg"
    if name not in POLICY_TERMS:
        register_policy_term(PolicyTerm(
            name=name, fn=_my_pg_loss, fields=("beta",), ratio="none", detached=(), aggregation="token_mean",
            text=lambda o: f"x_t = − {o.beta:g} · A_t · log π_θ(y_t)",
            call=lambda o, x: _my_pg_loss(x.logp, x.advantages, x.mask, scale=o.beta, **x.agg),
        ))
        register_advantage_estimator(AdvantageEstimator(
            name="test_centred_sum", level="sequence", fields=(), min_group=2,
            call=lambda o, r, gids=None: ADVANTAGE_ESTIMATORS["group_center"].call(o, r, gids),
            text=lambda o: "A_i = R_i − mean_G(R) (user estimator)",
        ))
    with pytest.raises(ValueError, match="already registered"):
        register_policy_term(POLICY_TERMS[name])
    o = Objective(name="mine", loss=name, advantage="test_centred_sum", aggregation="token_mean", group_size=4, beta=0.5)
    text = explain(o)
    assert "− 0.5 · A_t" in text and "user estimator" in text
    assert "beta" in o.read_fields()
    assert "0.5  →  0.1" in explain_diff(o, o.replace(beta=0.1))
    # verify passes the user's own function against the recipe built on it
    report = verify(lambda lp, old, adv, m, denominator=None: _my_pg_loss(lp, adv, m, scale=0.5, denominator=denominator),
                    reference=o)
    assert report.passed, report.table()
    # and catches a wrong scale
    assert not verify(lambda lp, old, adv, m: _my_pg_loss(lp, adv, m, scale=0.4), reference=o).passed


def test_registry_rejects_malformed_entries():
    with pytest.raises(ValueError, match="ratio"):
        register_policy_term(PolicyTerm(name="x1", fn=_my_pg_loss, fields=(), ratio="current", detached=(),
                                        aggregation="token_mean", text=str, call=lambda o, x: None))
    with pytest.raises(ValueError, match="call"):
        register_policy_term(PolicyTerm(name="x2", fn=_my_pg_loss, fields=(), ratio="none", detached=(),
                                        aggregation="token_mean", text=str))
    with pytest.raises(ValueError, match="level"):
        register_advantage_estimator(AdvantageEstimator(name="x3", level="episode", call=None, fields=(), text=str))


def test_explain_diff_names_every_difference_with_both_equations():
    text = explain_diff(get_recipe("grpo", kl_placement="loss", kl_coef=0.04), "dr_grpo")  # DeepSeekMath's KL
    for piece in ("advantage", "aggregation", "KL to reference", "kl_coef", "constant", "(not read)",
                  "std_G(R)", "no std scaling", "seq_mean_token_mean", "seq_sum_constant"):
        assert piece in text, piece
    assert "identical:" in text and "per-token term" in text.split("identical:")[1]
    same = explain_diff("grpo", "grpo")
    assert "none (the two recipes optimize the same objective)" in same
    with pytest.raises(ValueError, match="recipe"):
        explain_diff("grpo", "nope")


# comparisons whose string is not one of our names although it is spelled like one:
# baselines' ``scale="batch_std"`` option (the estimator of that name calls it); TRL's own loss_type values
NOT_OUR_NAMES = {("trajgrad.advantages.baselines", "batch_std"), ("trajgrad.peers.trl", "dapo"), ("trajgrad.peers.trl", "cispo")}
REGISTRY_MODULES = {"trajgrad.registry", "trajgrad.objective.__init__", "trajgrad.objective._core",
                    "trajgrad.objective._recipes", "trajgrad.objective._validate", "trajgrad.objective._explain",
                    "trajgrad.peers._cases"}


def _names_compared(tree):
    """String constants that a comparison (==, !=, in, not in) tests against, with line numbers."""
    import ast

    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            for side in [n.left, *n.comparators]:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                for c in items:
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        yield n.lineno, c.value
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Dict):  # {"ppo": ...}[o.loss]
            for k in n.value.keys:
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    yield n.lineno, k.value


def test_no_module_outside_the_registry_compares_a_recipe_loss_or_estimator_name():
    """Searching src/ for recipe or loss names finds them only in the registry, presets and docs:
    every other module reads the Objective's declared properties (kind, ratio_source, critic, ...)."""
    import ast
    from pathlib import Path

    import trajgrad

    root = Path(trajgrad.__file__).parent
    # "none" is also every switch's off value (kl_placement, ratio_source), "return" a Python word
    names = (set(RECIPES) | set(POLICY_TERMS) | set(ADVANTAGE_ESTIMATORS)) - {"none", "return"}
    offenders, scanned = [], 0
    for path in sorted(root.rglob("*.py")):
        module = "trajgrad." + ".".join(path.relative_to(root).with_suffix("").parts)
        if module in REGISTRY_MODULES:
            continue
        scanned += 1
        for line, value in _names_compared(ast.parse(path.read_text())):
            if value in names and (module, value) not in NOT_OUR_NAMES:
                offenders.append(f"{module}:{line} compares {value!r}")
    assert scanned > 60
    assert not offenders, offenders


def test_distillation_recipes_print_what_they_optimize():
    """The JSD term's β and convention change the loss and the explain text; gkd at β = 0 and 1
    is the forward and the reverse KL (TRL's generalized_jsd_loss convention)."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 4, 6, generator=g, dtype=F64)
    t = torch.randn(2, 4, 6, generator=g, dtype=F64)
    m = torch.ones(2, 4, dtype=torch.bool)
    m[1, 2:] = False

    def run(o):
        x = s.clone().requires_grad_(True)
        loss = o.distill_loss(student_logits=x, teacher_logits=t, mask=m).loss
        (gx,) = torch.autograd.grad(loss, x)
        return loss.detach(), gx

    base = RECIPES["gkd"]
    for field, value in (("jsd_beta", 0.2), ("jsd_normalized", "normalized")):
        o = base.replace(**{field: value})
        assert explain(o) != explain(base)
        assert not torch.equal(run(o)[0], run(base)[0])
    for beta, ref in ((0.0, losses.forward_kl_distill_loss), (1.0, losses.reverse_kl_distill_loss)):
        o = base.replace(jsd_beta=beta)
        x = s.clone().requires_grad_(True)
        want = ref(student_logits=x, teacher_logits=t, mask=m).loss
        (gw,) = torch.autograd.grad(want, x)
        got, gg = run(o)
        assert torch.allclose(got, want.detach(), atol=1e-12) and torch.allclose(gg, gw, atol=1e-12)
    from trajgrad.verify import verify

    own = lambda student_logits, teacher_logits, mask: base.distill_loss(  # noqa: E731
        student_logits=student_logits, teacher_logits=teacher_logits, mask=mask)
    assert verify(own, "gkd").passed
    assert not verify(own, "opd").passed
