"""The ``lagrangian`` policy term (§22: −(J_R − sg[λ] (J_C − d))) from a recipe: value and gradient equal a
hand-written float64 loop, λ receives no gradient, the multiplier supplies λ per update
(``LagrangeMultiplier.bind``), ``explain`` prints the term with λ's source and ``explain --diff`` names its
fields; the cost advantages are a checked batch input; a training config naming the term is refused at load
time."""
import math

import pytest
import torch

from trajgrad.aggregate import Normalizer
from trajgrad.control import LagrangeMultiplier
from trajgrad.losses.lagrangian import lagrangian_policy_loss
from trajgrad.objective import explain, explain_diff, get_recipe

D64 = torch.float64


def _recipe(**kw):
    return get_recipe("grpo", loss="lagrangian", aggregation=kw.pop("aggregation", "token_mean"), **kw)


def _hand(logp, old, adv_r, adv_c, mask, lam, d, aggregation):
    """§22 by a loop: ρ_t = exp(logp_t − old_t); J_X = agg(ρ A^X); loss = −(J_R − λ (J_C − d))."""
    B, L = mask.shape
    rows_r, rows_c = [], []
    for b in range(B):
        r = [torch.exp(logp[b, t] - old[b, t]) * adv_r[b, t] for t in range(L) if mask[b, t]]
        c = [torch.exp(logp[b, t] - old[b, t]) * adv_c[b, t] for t in range(L) if mask[b, t]]
        rows_r.append(r)
        rows_c.append(c)
    if aggregation == "token_mean":
        n = sum(len(r) for r in rows_r)
        j_r = sum(x for r in rows_r for x in r) / n
        j_c = sum(x for r in rows_c for x in r) / n
    else:  # seq_mean_token_mean over rows with a valid token
        keep = [i for i, r in enumerate(rows_r) if r]
        j_r = sum(sum(rows_r[i]) / len(rows_r[i]) for i in keep) / len(keep)
        j_c = sum(sum(rows_c[i]) / len(rows_c[i]) for i in keep) / len(keep)
    return -(j_r - lam * (j_c - d))


def _batch(seed, B=4, L=6, per_row=False):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 2
    old = logp + 0.3 * torch.randn(B, L, generator=g, dtype=D64)
    if per_row:
        adv_r, adv_c = torch.randn(B, generator=g, dtype=D64), torch.rand(B, generator=g, dtype=D64)
    else:
        adv_r, adv_c = torch.randn(B, L, generator=g, dtype=D64), torch.rand(B, L, generator=g, dtype=D64)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[:, 0] = True
    return logp, old, adv_r, adv_c, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("per_row", [False, True])
def test_value_and_gradient_equal_the_hand_loop(aggregation, per_row):
    logp, old, adv_r, adv_c, mask = _batch(0, per_row=per_row)
    o = _recipe(lagrangian_lambda=1.7, lagrangian_budget=0.3, aggregation=aggregation)
    lp = logp.clone().requires_grad_(True)
    res = o.policy_loss(lp, adv_r, mask, old_logp=old, cost_advantages=adv_c)
    (g,) = torch.autograd.grad(res.loss, lp)
    lp2 = logp.clone().requires_grad_(True)
    full = lambda a: a[:, None].expand(mask.shape) if a.ndim == 1 else a  # noqa: E731
    want = _hand(lp2, old, full(adv_r), full(adv_c), mask, 1.7, 0.3, aggregation)
    (g2,) = torch.autograd.grad(want, lp2)
    assert float(res.loss.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    assert torch.allclose(g, g2, rtol=1e-12, atol=1e-15)
    assert float(res.metrics["lagrangian/lambda"]) == 1.7
    # the gradient is that of a policy-gradient loss on A_R − λ A_C (the budget shifts the value only)
    d0 = o.replace(lagrangian_budget=0.0).policy_loss(lp, adv_r, mask, old_logp=old, cost_advantages=adv_c).loss
    assert float(d0.detach() - res.loss.detach()) == pytest.approx(1.7 * 0.3, rel=1e-12)  # − λ d


def test_the_multiplier_receives_no_gradient():
    logp, old, adv_r, adv_c, mask = _batch(1)
    lam = torch.tensor(0.8, dtype=D64, requires_grad=True)
    lp = logp.clone().requires_grad_(True)
    loss = lagrangian_policy_loss(lp, old, adv_r, adv_c, mask, multiplier=lam, budget=0.2).loss
    loss.backward()
    assert lam.grad is None and lp.grad is not None
    assert all(v is not lam for v in _leaves(loss)) and any(v is lp for v in _leaves(loss))


def _leaves(t):
    out, todo = [], [t.grad_fn]
    while todo:
        f = todo.pop()
        if f is None:
            continue
        if hasattr(f, "variable"):
            out.append(f.variable)
        todo += [n for n, _ in f.next_functions]
    return out


def test_the_worked_example_of_the_docstring():
    lp = torch.log(torch.tensor([[0.5, 0.5]], dtype=D64)).requires_grad_(True)
    o = _recipe(lagrangian_lambda=2.0, lagrangian_budget=0.1)
    res = o.policy_loss(lp, torch.tensor([1.0], dtype=D64), torch.ones(1, 2), old_logp=lp.detach(),
                        cost_advantages=torch.tensor([0.5], dtype=D64))
    (g,) = torch.autograd.grad(res.loss, lp)
    assert float(res.loss.detach()) == pytest.approx(-0.2, abs=1e-15)
    assert g.tolist() == [[0.0, 0.0]]
    assert float(res.metrics["lagrangian/violation"]) == pytest.approx(0.4)


def test_nan_and_inf_at_masked_positions_change_nothing():
    logp, old, adv_r, adv_c, mask = _batch(2)
    o = _recipe(lagrangian_lambda=0.6, lagrangian_budget=0.1)
    lp = logp.clone().requires_grad_(True)
    ref = o.policy_loss(lp, adv_r, mask, old_logp=old, cost_advantages=adv_c).loss
    (g,) = torch.autograd.grad(ref, lp)
    bad = lambda x, v: torch.where(mask, x, torch.tensor(v, dtype=D64))  # noqa: E731
    lp2 = bad(logp, math.nan).requires_grad_(True)
    got = o.policy_loss(lp2, bad(adv_r, math.inf), mask, old_logp=bad(old, -math.inf),
                        cost_advantages=bad(adv_c, math.nan)).loss
    (g2,) = torch.autograd.grad(got, lp2)
    assert torch.equal(got, ref) and torch.equal(g2, g)


def test_micro_batches_with_a_global_denominator_sum_to_the_full_batch():
    logp, old, adv_r, adv_c, mask = _batch(3)
    o = _recipe(lagrangian_lambda=1.3, lagrangian_budget=0.4)
    full = o.policy_loss(logp, adv_r, mask, old_logp=old, cost_advantages=adv_c).loss
    den = Normalizer.from_masks([mask[:1], mask[1:]], "token_mean", constant=None).denominator()
    parts = [o.policy_loss(logp[s], adv_r[s], mask[s], old_logp=old[s], cost_advantages=adv_c[s], denominator=den).loss
             for s in (slice(0, 1), slice(1, None))]
    assert float(sum(parts)) == pytest.approx(float(full), rel=1e-12)


def test_the_multiplier_supplies_lambda_per_update():
    logp, old, adv_r, adv_c, mask = _batch(4)
    o = _recipe(lagrangian_budget=0.25)
    mult = LagrangeMultiplier(init=0.5, lr=0.1, budget=0.25)
    bound = mult.bind(o)
    assert bound.lagrangian_lambda == 0.5 and "λ = 0.5, d = 0.25" in explain(bound)
    mult.update(1.25)  # λ ← max(0, 0.5 + 0.1 · (1.25 − 0.25)) = 0.6
    bound2 = mult.bind(o)
    assert bound2.lagrangian_lambda == pytest.approx(0.6)
    l1 = bound.policy_loss(logp, adv_r, mask, old_logp=old, cost_advantages=adv_c).loss
    l2 = bound2.policy_loss(logp, adv_r, mask, old_logp=old, cost_advantages=adv_c).loss
    direct = lagrangian_policy_loss(logp, old, adv_r, adv_c, mask, multiplier=mult).loss
    assert torch.equal(l2, direct) and not torch.equal(l1, l2)
    with pytest.raises(ValueError, match="^lagrangian_budget: the recipe's budget 0.1 differs"):
        mult.bind(_recipe(lagrangian_budget=0.1))
    with pytest.raises(ValueError, match="^lagrangian_lambda: has no effect"):
        LagrangeMultiplier(init=0.5).bind(get_recipe("grpo"))  # a recipe without the term
    with pytest.raises(ValueError, match="^budget: .* differs from the multiplier's budget"):
        lagrangian_policy_loss(logp, old, adv_r, adv_c, mask, multiplier=mult, budget=0.3)


def test_explain_prints_the_term_and_diff_names_its_fields():
    o = _recipe(lagrangian_lambda=2.0, lagrangian_budget=0.1)
    text = explain(o)
    assert "x_t = − ρ_t A^R_t + sg[λ] · (ρ_t A^C_t − d),   λ = 2, d = 0.1" in text
    assert "− (J_R − sg[λ] · (J_C − d))" in text and "LagrangeMultiplier.bind" in text
    assert "λ (the multiplier), cost advantages" in text.split("detached (stop-gradient):")[1]
    head = explain_diff(_recipe(), o).split("\n\n")[1]
    assert "  lagrangian_lambda  0  →  2" in head and "  lagrangian_budget  0  →  0.1" in head
    head = explain_diff("grpo", o).split("\n\n")[1]
    assert "  loss " in head and "lagrangian_lambda" in head and "lagrangian_budget" in head


@pytest.mark.parametrize("kw,field", [(dict(lagrangian_lambda=-0.1), "lagrangian_lambda"),
                                      (dict(lagrangian_lambda=math.inf), "lagrangian_lambda"),
                                      (dict(lagrangian_budget=math.nan), "lagrangian_budget"),
                                      (dict(lagrangian_budget="1"), "lagrangian_budget")])
def test_bad_fields_name_themselves(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        _recipe(**kw)
    with pytest.raises(ValueError, match=f"^{field}: has no effect"):
        get_recipe("grpo", **{field: 0.5})


def test_cost_advantages_are_a_checked_batch_input():
    logp, old, adv_r, adv_c, mask = _batch(5)
    o = _recipe()
    with pytest.raises(ValueError, match="^cost_advantages: required by loss 'lagrangian'"):
        o.policy_loss(logp, adv_r, mask, old_logp=old)
    with pytest.raises(ValueError, match="^cost_advantages: loss 'ppo' reads no cost advantages"):
        get_recipe("grpo").policy_loss(logp, adv_r, mask, old_logp=old, cost_advantages=adv_c)
    with pytest.raises(ValueError, match=r"^cost_advantages: expected shape \(4, 6\) \(the shape of advantages\)"):
        o.policy_loss(logp, adv_r, mask, old_logp=old, cost_advantages=adv_c[:, :3])
    with pytest.raises(ValueError, match="^cost_advantages:"):
        o.policy_loss(logp, adv_r, mask, old_logp=old, cost_advantages=torch.where(mask, math.nan, adv_c))


@pytest.mark.parametrize("recipe,loss,key,needs", [
    ("grpo", "lagrangian", "constraint.enabled", "loss 'lagrangian' takes λ from the cost constraint's multiplier"),
    ("opd", "multi_teacher", "recipe.overrides.loss", "loss 'multi_teacher' reads the batch input 'teachers', "
     "which the trainer does not supply")])
def test_a_training_config_without_the_terms_inputs_is_refused_at_load_time(tmp_path, monkeypatch, recipe, loss, key,
                                                                             needs):
    from typer.testing import CliRunner

    from trajgrad.cli import app

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["train", "--preset", "tiny", "--set", f"recipe.name={recipe}",
                                   "--set", f"recipe.overrides.loss={loss}"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith(f"error: {key}: {needs}"), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_turn_rewards_leave_the_cost_to_the_term_when_asked():
    from types import SimpleNamespace

    from trajgrad.train.rewards import turn_rewards

    batch = SimpleNamespace(turn_rewards=torch.tensor([[1.0, 0.5]]), turn_mask=torch.tensor([[True, True]]),
                            turn_costs=torch.tensor([[0.2, 0.4]]))
    mult = LagrangeMultiplier(init=2.0)
    r, info = turn_rewards(batch, gamma=1.0, shaping=False, lagrange=mult)
    assert r[0].tolist() == pytest.approx([0.6, -0.3])
    r2, info2 = turn_rewards(batch, gamma=1.0, shaping=False, lagrange=mult, penalize=False)
    assert r2.tolist() == [[1.0, 0.5]] and info2 == info == {"constraint/mean_cost": pytest.approx(0.6),
                                                            "constraint/lambda": 2.0}


def _lagrangian_config(**constraint):
    from test_train import micro_config

    return micro_config("grpo", recipe={"name": "grpo", "overrides": {"loss": "lagrangian", "lagrangian_budget": 0.1,
                                                                      "lagrangian_lambda": 0.3}},
                        constraint={"enabled": True, "budget": 0.1, "init": 0.3, "lr": 0.5, **constraint})


def test_the_trainer_runs_the_term_with_the_multipliers_lambda_and_the_cost_advantages(tmp_path, monkeypatch):
    """A tiny model, two steps: each step's loss gets the estimator on the episodes' costs and the multiplier's
    λ of that step (after step 1, λ ← max(0, λ + η (C̄ − d))); the costs stay out of the rewards."""
    import trajgrad.train.trainer as trainer_mod
    from trajgrad.objective import Objective
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.rewards import turn_rewards

    g = torch.Generator().manual_seed(0)
    batches, calls = [], []
    collate = trainer_mod.collate

    def with_costs(trajs, pad_id):  # the tiny model calls no tool: give each turn a cost
        batch = collate(trajs, pad_id)
        batch.turn_costs = torch.where(batch.turn_mask, torch.rand(batch.turn_mask.shape, generator=g), 0.0).float()
        batches.append(batch)
        return batch

    policy_loss = Objective.policy_loss

    def spy(self, *a, **k):
        calls.append((self.lagrangian_lambda, k["cost_advantages"], a[0]))
        return policy_loss(self, *a, **k)

    monkeypatch.setattr(trainer_mod, "collate", with_costs)
    monkeypatch.setattr(Objective, "policy_loss", spy)
    torch.manual_seed(0)
    tr = trainer_mod.Trainer(_lagrangian_config(), tmp_path / "run", console=lambda *_: None)
    tr.run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2] and len(batches) == 2
    mean_cost = [float(torch.where(b.turn_mask, b.turn_costs.double(), 0.0).sum(1).mean()) for b in batches]
    lam = [0.3, max(0.0, 0.3 + 0.5 * (mean_cost[0] - 0.1))]
    for step, (batch, row) in enumerate(zip(batches, rows)):
        got = [c for c in calls if c[0] == pytest.approx(lam[step])]
        assert got, (lam, [c[0] for c in calls])
        costs = torch.where(batch.turn_mask, batch.turn_costs.double(), 0.0).sum(1)
        want = tr.objective.sequence_advantages(costs, group_ids=batch.group_ids).advantages.double()
        assert sorted(torch.cat([c[1] for c in got]).tolist()) == pytest.approx(sorted(want.tolist()))
        # the reward advantages are those of the rewards without the cost penalty
        unpenalized = turn_rewards(batch, gamma=tr.objective.gamma, shaping=tr.cfg.task.shaping)[0].sum(1)
        adv = tr.objective.sequence_advantages(unpenalized, group_ids=batch.group_ids).advantages.double()
        per_row = [c[2] if c[2].ndim == 1 else c[2][:, 0] for c in got]  # [B, L] rows constant per response
        assert sorted(torch.cat(per_row).tolist()) == pytest.approx(sorted(adv.tolist()))
        assert row["lagrangian/lambda"] == pytest.approx(lam[step]) == row["constraint/lambda"]
        assert row["constraint/mean_cost"] == pytest.approx(mean_cost[step], rel=1e-6)
    assert tr.lagrange.value == pytest.approx(max(0.0, lam[1] + 0.5 * (mean_cost[1] - 0.1)), rel=1e-6)


@pytest.mark.parametrize("sets,key", [
    (dict(enabled=False), "constraint.enabled"),
    (dict(budget=0.2), "recipe.overrides.lagrangian_budget"),
    (dict(init=0.0), "recipe.overrides.lagrangian_lambda"),
])
def test_the_trainer_needs_the_constraint_that_supplies_lambda(sets, key):
    from trajgrad.train.config_checks import check_config

    with pytest.raises(ValueError, match=f"^{key}: "):
        check_config(_lagrangian_config(**sets))
