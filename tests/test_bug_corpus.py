"""Every bug shape in examples/bugs/ is caught by verify, by the check that names it."""
from pathlib import Path

import pytest

from trajgrad.verify import load_callable, verify

BUGS = Path(__file__).resolve().parents[1] / "examples" / "bugs"

# file:function, reference, verify options, the checks that must fail (at least these)
CORPUS = [
    ("per_rank_mean.py:loss", "dapo", {}, {"ranks_average"}),
    ("grad_accum_twice.py:loss", "dapo", {}, {"value", "gradient"}),
    ("gspo_length_broadcast.py:loss", "gspo", {}, {"value", "gradient"}),
    ("mask_multiply_nan.py:loss", "dapo", {}, {"masked_nan"}),
    ("topp_unnormalized.py:logprobs", "logprobs", {}, {"value", "normalized"}),
    ("gspo_token_detach.py:gspo_token_loss", "gspo_token", {}, {"gradient"}),
    ("seq_is_overflow.py:loss", "gspo", {}, {"long_sequence"}),
    ("sao_attached_as_detached.py:loss", "sao", {}, {"gradient"}),
    ("kl_on_observations.py:loss", "grpo", {"include_kl": True, "kl_placement": "loss", "kl_coef": 0.04},
     {"value", "masked_nan"}),
]


@pytest.mark.parametrize("target,reference,options,expected", CORPUS, ids=[c[0].split(":")[0] for c in CORPUS])
def test_each_bug_is_caught_by_its_check(target, reference, options, expected):
    path, fn = target.split(":")
    report = verify(load_callable(f"{BUGS / path}:{fn}"), reference, **options)
    failed = {c.name for c in report.checks if c.passed is False}
    assert not report.passed
    assert expected <= failed, (report.table(), failed)


def test_every_file_of_the_corpus_is_listed_here_and_in_its_readme():
    files = {p.name for p in BUGS.glob("*.py") if not p.name.startswith("_")}
    listed = {c[0].split(":")[0] for c in CORPUS}
    assert files == listed
    readme = (BUGS / "README.md").read_text()
    for name in files:
        assert name in readme, name


def test_the_correct_forms_pass_the_same_checks():
    """The references the corpus is compared with pass their own battery (the checks can pass)."""
    from trajgrad.logprobs import token_logprobs
    from trajgrad.objective import get_recipe

    for name in ("dapo", "gspo", "gspo_token", "sao"):
        o = get_recipe(name)

        def own(logp, old, adv, mask, denominator=None, o=o):
            return o.policy_loss(logp, adv, mask, old_logp=old, denominator=denominator)

        assert verify(own, name).passed, name
    grpo = get_recipe("grpo", kl_placement="loss", kl_coef=0.04)

    def with_kl(logp, old, adv, mask, ref_logp, denominator=None):
        return grpo.policy_loss(logp, adv, mask, old_logp=old, ref_logp=ref_logp, denominator=denominator)

    assert verify(with_kl, grpo, include_kl=True).passed
    assert verify(token_logprobs, "logprobs").passed
