"""Per-turn metrics of the rollout correction (each drop reason separately) and the
sampler–learner mismatch per turn, against hand computation on a hand-made batch."""
import math
from types import SimpleNamespace

import pytest
import torch

from trajgrad.logprobs.correction import rollout_correction, turn_metrics
from trajgrad.turn_stats import group_stats, mismatch_by_turn
from trajgrad.objective import RECIPES
from trajgrad.train import update_metrics

F64 = torch.float64
NAN, INF = float("nan"), float("inf")

# two responses, three turns; row 1 has a prompt/observation gap (mask 0) between its turns
MASK = torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0],
                     [1, 1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
TURN = torch.tensor([[0, 0, 0, 9, 1, 1, 9, 9],
                     [0, 0, 9, 9, 1, 1, 2, 2]])
BEH = torch.tensor([[-1.0, -2.0, -0.5, NAN, -1.0, -3.0, NAN, NAN],
                    [-0.2, -1.0, NAN, NAN, -0.7, -2.0, -1.5, -0.1]], dtype=F64)
# log-ratios z = target - behaviour at the valid tokens
Z = torch.tensor([[0.1, 1.2, -0.9, 0.0, 0.3, 2.0, 0.0, 0.0],
                  [-0.05, 0.0, 0.0, 0.0, -1.0, 0.15, 0.7, -0.3]], dtype=F64)
TGT = torch.where(MASK, BEH + Z, torch.tensor(INF, dtype=F64))


def _hand(weights, drops, keep):
    """Per-turn values by explicit loops over the tokens."""
    out = {}
    for k in (0, 1, 2):
        toks = [(i, t) for i in range(2) for t in range(8) if MASK[i, t] and TURN[i, t] == k]
        n = len(toks)
        w = [float(weights[i][t]) for i, t in toks]
        z = [float(Z[i, t]) for i, t in toks]
        p = f"correction/turn{k}/"
        out[p + "weight/mean"] = sum(w) / n
        out[p + "weight/min"], out[p + "weight/max"] = min(w), max(w)
        sq = sum(x * x for x in w)
        out[p + "ess"] = sum(w) ** 2 / sq / n if sq > 0 else 0.0
        kept = sum(bool(keep[i][t]) for i, t in toks) / n
        out[p + "kept_frac"], out[p + "dropped_frac"] = kept, 1 - kept
        for r in ("truncated", "masked", "rejected", "seq_masked"):
            out[p + r + "_frac"] = sum(bool(drops[r][i][t]) for i, t in toks) / n
        out[p + "kl/k1"] = sum(-x for x in z) / n
        out[p + "kl/k3"] = sum(math.exp(x) - 1 - x for x in z) / n
    return out


def test_masked_rejected_and_sequence_masked_fractions_per_turn():
    # MIS bounds [0.5, 2]: tokens with |z| > log 2 ≈ 0.693 are masked: (0,1) z=1.2, (0,2) −0.9, (0,5) 2.0,
    # (1,4) −1.0, (1,6) 0.7; token-level k2 rejection at 0.02: ½z² > 0.02 <=> |z| > 0.2
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    corr = rollout_correction(BEH, TGT, MASK, kind="mis", bounds=(0.5, 2.0), reject="k2", reject_threshold=0.02,
                              reject_level="token", seq_mask_delta=0.05, advantages=adv)
    rho = Z.exp()
    masked = [[bool(MASK[i, t]) and not (0.5 <= float(rho[i, t]) <= 2.0) for t in range(8)] for i in range(2)]
    rejected = [[bool(MASK[i, t]) and 0.5 * float(Z[i, t]) ** 2 > 0.02 for t in range(8)] for i in range(2)]
    # row 1: A < 0 and mean(log mu − log pi) = −mean(z) = −(−0.05 + 0 − 1 + 0.15 + 0.7 − 0.3)/6 ≈ 0.083 > 0.05
    seq_masked = [[False] * 8, [bool(MASK[1, t]) for t in range(8)]]
    drops = {"truncated": [[False] * 8] * 2, "masked": masked, "rejected": rejected, "seq_masked": seq_masked}
    keep = [[bool(MASK[i, t]) and not (masked[i][t] or rejected[i][t] or seq_masked[i][t]) for t in range(8)]
            for i in range(2)]
    weights = [[float(rho[i, t]) if keep[i][t] else 0.0 for t in range(8)] for i in range(2)]
    got = turn_metrics(corr, BEH, TGT, MASK, TURN)
    want = _hand(weights, drops, keep)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    # each reason is counted on its own: turn 0 has masked and rejected tokens, turn 2 only sequence-masked
    assert got["correction/turn0/masked_frac"] == pytest.approx(2 / 5)  # (0,1), (0,2)
    assert got["correction/turn0/rejected_frac"] == pytest.approx(2 / 5)
    assert got["correction/turn2/seq_masked_frac"] == 1.0 and got["correction/turn2/kept_frac"] == 0.0
    assert "correction/turn9/kept_frac" not in got  # masked positions name no turn
    assert all(math.isfinite(v) for v in got.values())


def test_truncated_fraction_per_turn_and_through_the_trainer_helper():
    cap = 1.25  # log 1.25 ≈ 0.223: truncated where z > 0.223
    corr = rollout_correction(BEH, TGT, MASK, kind="tis", cap=cap)
    trunc = [[bool(MASK[i, t]) and float(Z[i, t]) > math.log(cap) for t in range(8)] for i in range(2)]
    none = [[False] * 8] * 2
    keep = MASK.tolist()
    weights = [[min(math.exp(float(Z[i, t])), cap) if MASK[i, t] else 0.0 for t in range(8)] for i in range(2)]
    want = _hand(weights, {"truncated": trunc, "masked": none, "rejected": none, "seq_masked": none}, keep)
    got = turn_metrics(corr, BEH, TGT, MASK, TURN)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert got["correction/turn1/truncated_frac"] == pytest.approx(2 / 4)  # (0,4) .3, (0,5) 2; not (1,4) −1, (1,5) .15
    obj = RECIPES["grpo"].replace(rollout_correction={"kind": "tis", "cap": cap})
    m = update_metrics.correction_metrics(obj, SimpleNamespace(action_mask=MASK, turn_ids=TURN), BEH, TGT)
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert m["correction/truncated_frac"] == pytest.approx(sum(map(sum, trunc)) / int(MASK.sum()))


def test_mismatch_kl_per_turn_by_hand():
    learner = torch.where(MASK, BEH + Z, torch.tensor(NAN, dtype=F64))
    got = mismatch_by_turn(learner, BEH, MASK, TURN)
    assert set(got) == {f"mismatch/turn{k}/kl_{e}" for k in (0, 1, 2) for e in ("k1", "k3")}
    for k in (0, 1, 2):
        zs = [float(Z[i, t]) for i in range(2) for t in range(8) if MASK[i, t] and TURN[i, t] == k]
        assert got[f"mismatch/turn{k}/kl_k1"] == pytest.approx(-sum(zs) / len(zs), rel=1e-12)
        assert got[f"mismatch/turn{k}/kl_k3"] == pytest.approx(sum(math.exp(z) - 1 - z for z in zs) / len(zs),
                                                                rel=1e-12)
    # the token-weighted mean of the turns is the step's value
    n = [int((MASK & (TURN == k)).sum()) for k in (0, 1, 2)]
    step = sum(got[f"mismatch/turn{k}/kl_k3"] * n[k] for k in (0, 1, 2)) / sum(n)
    assert step == pytest.approx(float((torch.expm1(Z) - Z)[MASK].mean()), rel=1e-12)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="^group_ids"):
        group_stats({"x": Z}, MASK, TURN.double())
    with pytest.raises(ValueError, match="^group_ids"):
        group_stats({"x": Z}, MASK, TURN[:, :-1])
    with pytest.raises(ValueError, match="^x"):
        group_stats({"x": Z[:, :-1]}, MASK, TURN)
    with pytest.raises(ValueError, match="^behaviour_logp"):
        mismatch_by_turn(BEH + Z, BEH[:, :-1], MASK, TURN)
    bad = BEH.clone()
    bad[0, 0] = NAN  # a valid token
    with pytest.raises(ValueError, match="^behaviour_logp"):
        mismatch_by_turn(BEH + Z, bad, MASK, TURN)
    with pytest.raises(ValueError, match="^mask"):
        mismatch_by_turn(BEH + Z, BEH, MASK.double() * 2, TURN)
