"""``Config.objective()`` is built and checked once per run: load-time checks, ``explain``, the
defaults line and the trainer share one :class:`~trajgrad.objective.Objective`."""
import torch
import yaml

from trajgrad.train import config as config_mod
from trajgrad.train.config import load_config
from trajgrad.train.config_sources import recipe_defaults_line
from trajgrad.train.mixture import explain_config
from trajgrad.train.trainer import Trainer

from test_train import micro_config


def _counting(monkeypatch):
    built = []
    real = config_mod.get_recipe

    def get_recipe(name, **overrides):
        built.append(name)
        return real(name, **overrides)

    monkeypatch.setattr(config_mod, "get_recipe", get_recipe)
    return built


def test_one_run_builds_its_objective_once(tmp_path, monkeypatch):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(micro_config("ppo").model_dump(mode="json")))
    built = _counting(monkeypatch)
    cfg = load_config(path)  # the schema, check_config, check_effective
    explain_config(cfg)
    recipe_defaults_line(cfg)
    torch.manual_seed(0)
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    assert built == ["ppo"]
    assert tr.objective is cfg.objective() is tr.learner.objective


def test_a_changed_setting_builds_it_again(monkeypatch):
    built = _counting(monkeypatch)
    cfg = micro_config("grpo")
    first = cfg.objective()
    assert cfg.objective() is first and built == ["grpo"]
    cfg.train.group_size = 4
    assert cfg.objective().group_size == 4 and built == ["grpo", "grpo"]
    cfg.recipe.overrides["eps_low"] = 0.1  # an in-place change of the overrides is seen too
    assert cfg.objective().eps_low == 0.1 and len(built) == 3
    assert cfg.objective() is cfg.objective() and len(built) == 3
