"""docs/conventions.md names what exists: every recipe field of its table is a field of Objective, every
``trajgrad.…`` path imports, and the token sets behind the estimators are public (exported from
``trajgrad.losses`` and their module's ``__all__``, each with a worked example in its docstring)."""
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

import trajgrad.losses as losses
from trajgrad.objective import Objective

DOC = (Path(__file__).resolve().parents[1] / "docs" / "conventions.md").read_text()
TOKEN_SETS = {"dppo": ("dppo_binary_divergence", "dppo_trust_mask"),
              "cov": ("token_covariance", "clip_cov_candidates", "kl_cov_top_tokens"),
              "multi_teacher": ("normalized_teacher_weights",)}


def test_every_field_of_the_table_is_a_recipe_field():
    fields = {f.name for f in dataclasses.fields(Objective)}
    rows = [line for line in DOC.splitlines() if line.startswith("| `")]
    named = {n for line in rows for n in re.findall(r"`([a-z_]+)`", line.split("|")[1])}
    assert len(rows) >= 9 and named - fields == set(), named - fields
    assert {"teacher_direction", "teacher_zero_sum", "lagrangian_lambda", "lagrangian_budget"} <= named


def test_every_module_path_imports():
    for path in set(re.findall(r"`(trajgrad(?:\.[a-z_]+)+)`", DOC)):
        try:
            importlib.import_module(path)
        except ImportError:
            module, attr = path.rsplit(".", 1)
            assert hasattr(importlib.import_module(module), attr), path


@pytest.mark.parametrize("module,name", [(m, n) for m, names in TOKEN_SETS.items() for n in names])
def test_the_token_sets_are_public_and_documented(module, name):
    mod = importlib.import_module(f"trajgrad.losses.{module}")
    assert name in mod.__all__ and name in losses.__all__ and getattr(losses, name) is getattr(mod, name)
    doc = getattr(mod, name).__doc__
    assert re.search(r"Worked\s+example", doc) and ":math:" in doc
    assert f"`{name}`" in DOC
