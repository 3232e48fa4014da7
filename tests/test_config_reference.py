"""The configuration reference is generated from the schema and checked in: ``docs/config.md``,
``trajgrad config --schema``, and ``trajgrad config CONFIG`` with the source of each value."""
from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from trajgrad.cli import app
from trajgrad.train.config_reference import config_rows, markdown

runner = CliRunner()
DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_what_the_code_generates():
    assert DOC.exists(), "docs/config.md is missing: trajgrad config --markdown > docs/config.md"
    assert DOC.read_text() == markdown(), "docs/config.md is out of date: trajgrad config --markdown > docs/config.md"


def test_every_key_has_a_type_default_description_and_readers():
    rows = config_rows()
    assert len(rows) > 90
    missing = [r[0] for r in rows if not r[3].strip()]
    assert not missing, f"config keys without a description: {missing}"
    keys = {r[0]: r for r in rows}
    assert keys["train.stop_on_no_signal"][2] == "false" and keys["train.no_signal_steps"][2] == "3"
    assert keys["critic.lr"][4].split(", ") == ["ppo", "sao", "verl-ppo"]
    assert keys["optim.lr"][4] == "all"
    text = markdown()
    for key in ("`recipe.overrides.kl_coef`", "`task.options.adapter.max_turns`", "`task.options.max_turns`",
                "`task.options.prompt_field`", "`task.options.few_shot`", "`sampling.temperature`"):
        assert key in text, key
    # every recipe field and every documented task option has its text
    for line in text.splitlines():
        if line.startswith("| `recipe.overrides.") or line.startswith("| `task.options."):
            assert line.split(" | ")[3].strip(), line


def test_config_schema_is_json_schema_of_every_section():
    res = runner.invoke(app, ["config", "--schema"])
    assert res.exit_code == 0, res.output
    schema = json.loads(res.output)
    assert set(schema["properties"]) >= {"model", "task", "train", "recipe", "sampling"}
    loop = schema["$defs"]["LoopConfig"]["properties"]
    assert loop["stop_on_no_signal"]["default"] is False and loop["steps"]["description"]
    res = runner.invoke(app, ["config", "--schema", "--preset", "tiny"])
    assert res.exit_code == 2 and "--schema" in res.output


def test_config_prints_each_value_with_its_source(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preset: tiny\nsampling: {temperature: 0.9}\nrecipe: {name: grpo}\n")
    res = runner.invoke(app, ["config", str(cfg), "--set", "train.steps=2"])
    assert res.exit_code == 0, res.output
    lines = {line.split(":")[0]: line for line in res.output.splitlines()}
    assert lines["sampling.temperature"].endswith(f"# file {cfg}") and ": 0.9" in lines["sampling.temperature"]
    assert lines["train.steps"].endswith("# --set")
    assert lines["sampling.max_new_tokens"].endswith("# preset tiny (file)")
    assert lines["train.seed"].endswith("# default")
    assert lines["recipe.kl_placement (resolved)"].endswith("# recipe.overrides.kl_placement")  # the preset's
    assert lines["recipe.eps_low (resolved)"].endswith("# recipe 'grpo' default")
    res = runner.invoke(app, ["config", "--preset", "tiny", "--set", "train.stpes=2"])
    assert res.exit_code == 2 and "train.stpes: unknown key" in res.output
