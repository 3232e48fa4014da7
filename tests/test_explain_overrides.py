"""``explain`` names every field a recipe changes from the named recipe it starts from.

The header's note describes the named recipe (e.g. grpo's "no KL term"); a configuration that
overrides fields prints one more line, so that the note never stands alone for a changed objective.
"""
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.objective import explain, get_recipe


def test_named_recipe_has_no_changed_line():
    for name in ("grpo", "ppo", "dr_grpo", "cispo", "sao"):
        assert "changed from the named recipe" not in explain(name)


def test_kl_override_is_named_next_to_the_note():
    text = explain("grpo", kl_coef=0.04, kl_placement="loss")
    header, changed = text.splitlines()[:2]
    assert "no KL term" in header  # the named recipe's note
    assert changed.startswith("changed from the named recipe 'grpo': ")
    assert "kl_coef 0 → 0.04" in changed and "kl_placement 'none' → 'loss'" in changed
    assert "KL to reference: in the loss: + 0.04" in text


def test_an_objective_passed_directly_is_compared_with_its_name():
    text = explain(get_recipe("grpo").replace(eps_low=0.1))
    assert text.splitlines()[1] == "changed from the named recipe 'grpo': eps_low 0.2 → 0.1"


@settings(max_examples=25, deadline=None)
@given(st.floats(min_value=0.01, max_value=0.9, allow_nan=False).filter(lambda x: abs(x - 0.2) > 1e-9))
def test_every_changed_read_field_is_listed(eps):
    line = explain("grpo", eps_low=eps).splitlines()[1]
    assert line.startswith("changed from the named recipe 'grpo': eps_low 0.2 → ")
    assert line.count("→") == 1
