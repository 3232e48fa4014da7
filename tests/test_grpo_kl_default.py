"""GRPO's KL term has one default everywhere (none), ``kl_coef: 0`` with ``kl_placement: none``
is accepted in a YAML file, with ``--set`` and in Python, and every run prints its KL setting."""
from __future__ import annotations

import pytest

from trajgrad.objective import RECIPES, explain, get_recipe
from trajgrad.train.config import load_config
from trajgrad.train.config_sources import recipe_defaults_line
from trajgrad.train.presets import PRESETS

TINY = "model: {name: tiny, lora: null}\n"


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(TINY + text)
    return p


def test_grpo_default_is_no_kl_as_explain_and_the_presets_say():
    assert (RECIPES["grpo"].kl_placement, RECIPES["grpo"].kl_coef) == ("none", 0.0)
    assert "KL to reference: none" in explain("grpo")
    for name in ("default", "tiny"):
        assert load_config(preset=name).objective().kl_placement == "none"
    assert PRESETS["default"]["recipe"]["name"] == "grpo"


@pytest.mark.parametrize("recipe", [
    "{name: grpo, overrides: {kl_coef: 0.0, kl_placement: none}}",  # the presets' own setting
    "{name: grpo, overrides: {kl_placement: none}}",
    "{name: grpo, overrides: {kl_coef: 0}}",
    "{name: grpo}",
])
def test_yaml_grpo_without_kl_is_accepted(tmp_path, recipe):
    o = load_config(_yaml(tmp_path, f"recipe: {recipe}\n")).objective()
    assert (o.kl_placement, o.kl_coef, o.uses_reference) == ("none", 0.0, False)


def test_set_kl_coef_zero_on_a_preset_is_accepted():
    for value in (0.0, 0):
        o = load_config(preset="tiny", overrides={"recipe.overrides.kl_coef": value}).objective()
        assert (o.kl_placement, o.kl_coef) == ("none", 0.0)
    # a KL coefficient that would do nothing is still refused, by name
    with pytest.raises(ValueError, match=r"^recipe\.overrides\.kl_coef: is nonzero but kl_placement is .none."):
        load_config(preset="tiny", overrides={"recipe.overrides.kl_coef": 0.1})


def test_python_grpo_without_kl_and_turning_off_other_recipes_kl():
    assert get_recipe("grpo", kl_coef=0.0, kl_placement="none") == RECIPES["grpo"]
    assert get_recipe("grpo", kl_placement="none") == RECIPES["grpo"]
    for name in ("ppo", "verl-grpo", "reinforce_pp"):  # recipes whose defaults have a KL term
        o = get_recipe(name, kl_placement="none")
        assert (o.kl_coef, o.uses_reference) == (0.0, False)
    with_kl = get_recipe("grpo", kl_placement="loss", kl_coef=0.04)  # DeepSeekMath's
    assert "+ 0.04 · aggregate(k3" in explain(with_kl)


def test_a_kl_term_with_coefficient_zero_is_refused():
    with pytest.raises(ValueError, match=r"^kl_coef: is 0 but kl_placement is 'loss'"):
        get_recipe("grpo", kl_placement="loss")
    with pytest.raises(ValueError, match=r"^recipe\.overrides\.kl_coef: is 0 but kl_placement is 'reward'"):
        load_config(preset="tiny", overrides={"recipe.overrides.kl_placement": "reward"})


def test_every_run_prints_its_kl_and_the_recipe_defaults_it_did_not_set(tmp_path, capsys):
    line = recipe_defaults_line(load_config(_yaml(tmp_path, "recipe: {name: grpo}\n")))
    assert line.startswith("recipe 'grpo': no KL term (kl_placement 'none') (recipe default)")
    assert "eps_low 0.2" in line and "group_size 8" in line and "rollout_correction 'off'" in line
    line = recipe_defaults_line(load_config(preset="tiny", overrides={"recipe.overrides.eps_low": 0.3}))
    assert "eps_low" not in line and "group_size" not in line  # set by --set and train.group_size
    line = recipe_defaults_line(load_config(preset="tiny", overrides={"recipe.name": "ppo", "train.group_size": 1,
                                                                      "recipe.overrides": {}}))
    assert line.startswith("recipe 'ppo': KL k1 in the reward, kl_coef 0.05 (recipe default)")

    from trajgrad.train.run import main

    over = {"train.steps": 0, "sft.steps": 0, "eval.before": False, "eval.after": False, "checkpoint.every": 0,
            "task.n_train": 8, "task.n_heldout": 2, "log.progress": False}
    assert main(preset="tiny", overrides=over, run_dir=tmp_path / "run") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "recipe 'grpo': no KL term (kl_placement 'none') (recipe.overrides)" in out

    import trajgrad

    said = []
    trajgrad.train(preset="tiny", overrides=over, run_dir=tmp_path / "api", console=said.append)
    assert any(s.startswith("recipe 'grpo': no KL term") for s in said)


def test_verify_with_kl_asks_for_a_kl_term_on_grpo():
    from trajgrad.verify import verify

    with pytest.raises(ValueError, match=r"^include_kl: recipe 'grpo' has no KL term .*--set kl_placement=loss"):
        verify(lambda *a, **k: None, "grpo", include_kl=True)
