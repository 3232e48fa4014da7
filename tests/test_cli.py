"""The command line: explain, verify, example, and config errors of train."""
from pathlib import Path

from typer.testing import CliRunner

from trajgrad.cli import app
from trajgrad.objective import RECIPES

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_explain_all_prints_twelve_recipes():
    res = runner.invoke(app, ["explain", "--all"])
    assert res.exit_code == 0, res.output
    for name in RECIPES:
        assert f"recipe: {name} " in res.output


def test_explain_with_override_and_bad_override():
    res = runner.invoke(app, ["explain", "dapo", "--set", "eps_high=0.4"])
    assert res.exit_code == 0 and "1 + 0.4" in res.output
    res = runner.invoke(app, ["explain", "dapo", "--set", "eps_hihg=0.4"])
    assert res.exit_code == 2 and "eps_hihg" in res.output


def test_verify_exit_codes():
    ok = runner.invoke(app, ["verify", f"{EXAMPLES}/my_ppo_clip.py:ppo_loss", "--as", "ppo"])
    assert ok.exit_code == 0, ok.output
    assert "overall: PASS" in ok.output
    bad = runner.invoke(app, ["verify", f"{EXAMPLES}/bugs/gspo_token_detach.py:gspo_token_loss", "--as", "gspo_token"])
    assert bad.exit_code == 1
    assert "gradient         FAIL" in bad.output and "value            PASS" in bad.output
    missing = runner.invoke(app, ["verify", "no_such_module_xyz:fn"])
    assert missing.exit_code != 0


def test_example_prints_spec_numbers():
    res = runner.invoke(app, ["example"])
    assert res.exit_code == 0
    assert "-0.48581" in res.output and "1.10517" in res.output and "0.90484" in res.output


def test_train_rejects_unknown_config_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  stpes: 3\n")
    res = runner.invoke(app, ["train", str(cfg)])
    assert res.exit_code == 2
    assert "train.stpes: unknown key" in res.output


def test_train_rejects_bad_value_naming_key():
    res = runner.invoke(app, ["train", "--preset", "tiny", "--set", "optim.lr=-1"])
    assert res.exit_code == 2 and "optim.lr" in res.output
    res = runner.invoke(app, ["train", "--preset", "nope"])
    assert res.exit_code == 2 and "preset" in res.output


def test_explain_diff_set_names_each_new_option_on_one_side_only():
    cases = [("cispo", ["mask_eps_high=0.28", "mask_eps_low=0.2"], "unified PPO mask"),
             ("gmpo", ["gmpo_clip_level=sequence"], "gmpo_clip_level"),
             ("maxrl", ["maxrl_eps_mode=add", "maxrl_eps=0.1"], "maxrl_eps_mode"),
             ("clip_cov", ["cov_band=closed"], "cov_band"),
             ("kl_cov", ["kl_cov_positive_only=false"], "kl_cov_positive_only")]
    for recipe, sets, shown in cases:
        args = ["explain", recipe, "--diff", recipe]
        for s in sets:
            args += ["--diff-set", s]
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
        differ = res.output.split("fields that differ:")[1].split("\n\n")[0]
        for s in sets:
            assert s.split("=")[0] in differ, (recipe, res.output)
        assert shown in res.output
    res = runner.invoke(app, ["explain", "cispo", "--diff-set", "mask_eps_high=0.28"])
    assert res.exit_code == 2 and "--diff-set: needs --diff" in res.output
    res = runner.invoke(app, ["explain", "gmpo", "--diff", "gmpo", "--diff-set", "gmpo_clip_level=rows"])
    assert res.exit_code == 2 and "gmpo_clip_level" in res.output and "Traceback" not in res.output
