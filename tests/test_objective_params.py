"""Objective's fields are composed from the Param declarations of the registry's entries."""
import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from trajgrad.objective import RECIPE_PARAMS, RECIPES, Objective
from trajgrad.registry import ADVANTAGE_ESTIMATORS, PARAMS, POLICY_TERMS, Param, declare

SRC = Path(__file__).resolve().parents[1] / "src"


def test_every_field_is_one_declaration_with_its_default_type_and_doc():
    fields = {f.name: f for f in dataclasses.fields(Objective)}
    assert set(fields) == set(PARAMS)
    hints = typing.get_type_hints(Objective)
    for name, p in PARAMS.items():
        assert hints[name] == p.annotation, name
        default = fields[name].default
        assert (default is dataclasses.MISSING) if p.default is dataclasses.MISSING else default == p.default, name
        assert p.doc and p.doc in " ".join(Objective.__doc__.split()), name


def test_each_field_is_declared_by_the_recipe_or_an_entry_that_reads_it():
    owners = {p.name for p in RECIPE_PARAMS}
    for entry in list(POLICY_TERMS.values()) + list(ADVANTAGE_ESTIMATORS.values()):
        owners |= {p.name for p in entry.params}
        # eps_high's default is eps_low; a pairwise recipe also reads its preference-loss fields
        extra = {"eps_low"} | ({"dpo_loss_type", "label_smoothing", "simpo_gamma"} if entry.name == "dpo" else set())
        assert {p.name for p in entry.params} <= set(entry.fields) | extra, entry.name
        assert set(entry.fields) <= set(PARAMS), entry.name
    assert owners == set(PARAMS)


def test_a_field_check_names_the_field():
    for name, value in [("cov_low", 5.0), ("weight_eps_low", 0.0), ("tau_pos", -1.0), ("gamma", 1.5),
                        ("jsd_normalized", "x"), ("std_unbiased", 1), ("dual_clip", 0.5), ("delta_low", float("nan"))]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            Objective(name="x", loss="ppo", advantage="group_std", aggregation="token_mean", group_size=2,
                      **{name: value})


def test_a_new_field_after_composition_is_refused():
    with pytest.raises(ValueError, match="^params: field 'brand_new' is new"):
        declare(Param("brand_new", 1.0, "a field nobody reads."))
    assert "brand_new" not in PARAMS
    with pytest.raises(ValueError, match="declared twice"):
        declare(Param("eps_low", 0.2, "again"))


def test_a_user_term_declared_before_the_objective_gets_its_field(tmp_path):
    code = """
import torch
from trajgrad.registry import Param, finite_positive, policy_term

SCALE = Param("my_scale", 1.0, "my term's scale.", float, lambda v: finite_positive("my_scale", v))

@policy_term("my_pg", fields=("my_scale",), params=(SCALE,), ratio="none", detached=(), aggregation="token_mean",
             text=lambda o: f"x_t = − {o.my_scale:g} · A_t · log π_θ(y_t)",
             call=lambda o, x: my_pg_loss(x.logp, x.advantages, x.mask, scale=o.my_scale))
def my_pg_loss(logp, advantages, mask, *, scale):
    from trajgrad.types import LossResult
    m = mask.bool()
    return LossResult(-(torch.where(m, logp * advantages * scale, 0.0)).sum() / m.sum(), {})

from trajgrad.objective import Objective, explain
o = Objective(name="mine", loss="my_pg", advantage="group_std", aggregation="token_mean", group_size=4, my_scale=0.5)
print(explain(o).count("0.5 · A_t"), o.replace(my_scale=2.0).my_scale)
try:
    Objective(name="mine", loss="my_pg", advantage="group_std", aggregation="token_mean", group_size=4, my_scale=-1.0)
except ValueError as e:
    print(str(e).split(":")[0])
"""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2.0", "my_scale"]


def test_recipes_are_unchanged_objects():
    assert all(isinstance(o, Objective) for o in RECIPES.values())


def test_eps_high_defaults_to_eps_low_in_one_place():
    from trajgrad.diagnostics import policy_metrics
    from trajgrad.losses import resolve_eps_high

    assert resolve_eps_high(0.2, None) == 0.2 and resolve_eps_high(0.2, 0.28) == 0.28
    assert RECIPES["grpo"].eps_high_ == 0.2 and RECIPES["dapo"].eps_high_ == 0.28
    import torch

    z = torch.tensor([[0.19, -0.21, 0.0]]).log1p()  # ratios 1.19, 0.79, 1
    adv, mask = torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3)
    sym = policy_metrics(z, adv, mask, eps_low=0.2)
    assert sym["clip_frac"].item() == pytest.approx(1 / 3)  # 0.79 < 0.8 with A < 0; 1.19 < 1.2
    assert policy_metrics(z, adv, mask, eps_low=0.2, eps_high=0.1)["clip_frac"].item() == pytest.approx(2 / 3)
