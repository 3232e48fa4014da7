"""trajgrad verify --peer: TRL's and verl's own code against trajgrad's recipes.

These run where the pinned peers are installed (`make peers`; CI runs this file in that
environment). Without them only the import-free parts run.
"""
import importlib.util

import pytest

from trajgrad.peers import PeerCase, cases, run_case

HAVE = {p: importlib.util.find_spec(p) is not None for p in ("trl", "verl")}


@pytest.mark.parametrize("peer", ["trl", "verl"])
def test_every_peer_function_agrees_outright_or_with_a_named_option(peer):
    if not HAVE[peer]:
        pytest.skip(f"{peer} is not installed here (CI runs this file in the peers environment, `make peers`)")
    results = [run_case(c) for c in cases(peer)]
    for r in results:
        assert r.error == "", (r.case.function, r.error)
        assert r.status.startswith("agrees"), (r.case.function, r.status, r.table)
    assert len(results) >= 9


def test_a_wrong_mapping_is_reported_as_differs():
    """The classification can fail: a peer function mapped to the wrong recipe differs."""
    if not HAVE["verl"]:
        pytest.skip("verl is not installed here (CI runs this file in the peers environment, `make peers`)")
    from functools import partial

    from trajgrad.peers import verl as V

    wrong = PeerCase("verl", "vanilla as sapo", partial(V.policy_loss, "vanilla", loss_agg_mode="token-mean"), "sapo")
    assert run_case(wrong).status == "differs"
    missing_option = PeerCase("verl", "grpo advantage, population std", V.grpo_advantage, "grpo", kind="advantage")
    assert run_case(missing_option).status == "differs"
    kl_cov_coef = PeerCase("verl", "kl_cov with the paper's β = 1", partial(V.cov_loss, "kl_cov"), "kl_cov",
                           kind="cov_topk")  # verl's PolicyLossConfig default is 0.1
    assert run_case(kl_cov_coef).status == "differs"
    unseeded_count = PeerCase("verl", "clip_cov, Dr. GRPO's clip range", partial(V.cov_loss, "clip_cov"), "clip_cov",
                              {"eps_low": 0.1}, kind="cov_random")
    assert run_case(unseeded_count).status == "differs"
    wrong_clip = PeerCase("verl", "value loss, clip 0.5 vs ppo's 0.2", V.value_loss, "ppo", kind="critic")
    assert run_case(wrong_clip).status == "differs"
    if HAVE["trl"]:
        from trajgrad.peers import trl as T

        ipo_as_dpo = PeerCase("trl", "ipo as sigmoid", partial(T.dpo_loss, "ipo"), "dpo", kind="pairwise")
        assert run_case(ipo_as_dpo).status == "differs"


def test_unknown_peer_is_a_clear_error():
    with pytest.raises(ValueError, match="peer"):
        cases("openrlhf")


def test_report_files(tmp_path):
    from trajgrad.peers import CaseResult, report

    case = PeerCase("verl", "f", lambda: None, "grpo")
    res = [CaseResult(case, "agrees with option x=1", 1e-12, [], ["masked_nan: NaN"], "table")]
    md, page = report.write("verl", "0.9.1", res, tmp_path)
    assert "| `f` | `grpo` |" in md.read_text() and "agrees with option x=1" in md.read_text()
    assert page.read_text().startswith("<!doctype html>") and "masked_nan" in page.read_text()


def test_clip_cov_is_compared_seeded_and_names_the_draw_difference():
    """verl's Clip-Cov draws tokens with torch's global RNG: the comparison reproduces its draw from the same
    seed, and names the one convention that differs (which tokens a seed selects)."""
    if not HAVE["verl"]:
        pytest.skip("verl is not installed here (CI runs this file in the peers environment, `make peers`)")
    (case,) = [c for c in cases("verl") if "clip_cov" in c.function]
    r = run_case(case)
    assert r.status == "agrees", r.table
    for name in ("selection_rule", "selection_count", "gradient_unselected", "selection_law", "gradient"):
        assert f"{name} " in r.table and "PASS" in r.table.split(f"{name} ", 1)[1].split("\n")[0], (name, r.table)
    assert any(c.startswith("same_tokens:") for c in r.conventions)


def test_token_weighted_normalization_differs_from_the_recipe_and_matches_the_core_form():
    """verl's REINFORCE++ whitens over tokens: against the recipe's response-weighted estimator it differs
    (the weights, and Bessel's correction over tokens), and the core form with lengths reproduces it."""
    if not HAVE["verl"]:
        pytest.skip("verl is not installed here (CI runs this file in the peers environment, `make peers`)")
    from functools import partial

    from trajgrad.peers import verl as V

    r = run_case(PeerCase("verl", "rf++ vs recipe", partial(V.outcome_advantage, "reinforce_plus_plus"),
                          "reinforce_pp", kind="advantage"))
    assert r.status == "differs", r.table
    (case,) = [c for c in cases("verl") if c.function.startswith("compute_reinforce_plus_plus_outcome")]
    assert case.ours is not None and run_case(case).status.startswith("agrees with option reinforce_pp_advantages")


@pytest.mark.parametrize("peer", ["trl", "verl"])
def test_functions_without_a_counterpart_differ_as_the_report_says(peer):
    if not HAVE[peer]:
        pytest.skip(f"{peer} is not installed here (CI runs this file in the peers environment, `make peers`)")
    from trajgrad.peers._cases import DIFFERS, UNCOVERED

    for case in DIFFERS[peer]:
        r = run_case(case)
        assert r.status == "differs" and r.conventions[0].startswith("no trajgrad counterpart"), r.table
        assert any(case.no_counterpart in why for _, why in UNCOVERED[peer])
