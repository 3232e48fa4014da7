"""tokens.jsonl: the batched writer produces the bytes of the per-value formulation.

The reference below is the writer as it was before it formatted a whole column at once
(one ``_num`` per value, a dict per row, ``json.dumps``); the lines must be equal byte for
byte on random inputs with masked positions, NaN / inf, subnormal and huge values, and
unicode episode ids.
"""
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from trajgrad.train import tokenlog
from trajgrad.train.tokenlog import StepRecord, _format6, _num, token_values


def _ref_floats(t):
    return [_num(float(x)) for x in t.detach().to(torch.float64).cpu().tolist()]


def _ref_lines(batch, step, learner_version, calls, epochs):
    """The previous row writer: a dict per row, one ``_num`` per value, ``json.dumps``."""
    rows = {}
    for objective, mb, idx, logp, entropy, advantages, old_logp, behaviour_logp, epoch in calls:
        mask, values = token_values(objective, mb, logp, entropy, advantages, old_logp, behaviour_logp)
        for r, b in enumerate(idx):
            m = mask[r]
            row = {"step": step, "episode_id": batch.episode_ids[b], "segment": int(batch.segments[b]),
                   "learner_version": learner_version, "epoch": int(epoch), "n": int(m.sum())}
            for k, v in values.items():
                if v is None:
                    row[k] = None
                elif k in ("zero_grad", "rc_keep"):
                    row[k] = [int(x) for x in v[r][m].tolist()]
                else:
                    row[k] = _ref_floats(v[r][m])
            rows[b] = row
    return [(json.dumps(dict(rows[b], epochs=int(epochs)), separators=(",", ":"), allow_nan=False) + "\n").encode()
            for b in sorted(rows)]


def test_token_values_keys_in_the_line_order():
    batch, calls = _case(1, "old", "bypass", 1)
    obj, mb, idx, logp, ent, adv, old, beh, epoch = calls[0]
    assert list(token_values(obj, mb, logp, ent, adv, old, beh)[1]) == [
        "adv", "logp", "old", "ratio", "grad", "zero_grad", "entropy", "is_weight", "rc_keep"]
    obj.ratio_source = "none"
    mask, values = token_values(obj, mb, logp, None, adv, old, None)
    assert list(values) == ["adv", "logp", "old", "ratio", "grad", "zero_grad"] and values["ratio"] is None


SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.0, 1e6, 999999.5, 999999.4, 9999995.0, 123456.5, 1234565.0, 1e15, 9.999995e15,
           1e16, 1.5e16, 1e-4, 9.999995e-5, 1e-5, 0.1, 1 / 3, -2 / 3, 1e100, 1e-100, 1e300, 2.2250738585072014e-308,
           2.225074e-308, 1e-310, 5e-324, -5e-324, 1.79768e308, 1.797685e308, 123.0, -4096.0, 65504.0,
           float("nan"), -float("nan"), float("inf"), -float("inf"), 0.5, 1.5, 2.5e-7, 7.0e10, 3.0e14,
           0.9999996, -0.99999951, 0.9999994, 99999.96, 99999.94, 0.59999996]


def _random_floats(rng, n):
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.15:
            out.append(rng.choice(SPECIAL))
        elif kind < 0.3:
            out.append(float(rng.randint(-10 ** rng.randint(0, 17), 10 ** rng.randint(0, 17))))
        elif kind < 0.45:  # ties and near-ties at the 6th significant digit
            e = rng.randint(-12, 20)
            out.append((rng.randint(100000, 999999) + rng.choice([0.5, 0.4999999, 0.5000001])) * 10.0 ** (e - 6))
        elif kind < 0.6:
            out.append(rng.uniform(-5, 5))
        else:
            out.append(rng.choice([-1, 1]) * rng.random() * 10.0 ** rng.uniform(-320, 308))
    return out


def _json_floats(vals):
    return "[" + ",".join(_format6(torch.tensor(vals, dtype=torch.float64))) + "]"


def test_format6_equals_json_dumps_of_the_rounded_values():
    rng = random.Random(0)
    for trial in range(400):
        vals = _random_floats(rng, rng.randint(0, 60))
        want = json.dumps([_num(x) for x in vals], separators=(",", ":"), allow_nan=False)
        assert _json_floats(vals) == want, vals


def test_format6_every_special_value():
    vals = list(SPECIAL)
    assert _json_floats(vals) == json.dumps([_num(x) for x in vals], separators=(",", ":"), allow_nan=False)
    assert _json_floats([1.7976931348623157e308, -1.7976931348623157e308]) == "[1.79769e+308,-1.79769e+308]"


class _Corr:
    """A stand-in rollout correction: a weight and a keep flag per token."""

    def __init__(self, mode, seed):
        self.mode, self.seq_mask_delta, self.seed = mode, None, seed

    def __bool__(self):
        return True

    def __call__(self, behaviour_logp, target, mask, advantages=None, current_logp=None):
        g = torch.Generator().manual_seed(self.seed)
        w = torch.exp(target.double() - behaviour_logp.double()).clamp(max=2.0)
        keep = (torch.rand(mask.shape, generator=g) > 0.2) & mask.bool()
        return SimpleNamespace(weight=torch.where(keep, w, torch.zeros_like(w)).float(), keep=keep.float())


def _case(seed, ratio_source, rc_mode, epochs):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    ids = ["calc-17#2-5", "é-ü-ß", "中文-任务#3", "emoji 😀 \"quoted\"\\", "tab\tnew\nline", "\u0000ctrl"]
    batch = SimpleNamespace(episode_ids=ids, segments=torch.tensor([0, 1, 0, 2, 0, 3]))
    rc = None if rc_mode is None else _Corr(rc_mode, seed)
    obj = SimpleNamespace(rollout_correction=rc, ratio_source=ratio_source)
    calls = []
    for epoch in range(epochs):
        for idx in ([0, 2, 4], [1, 3, 5]):
            mask = torch.rand(len(idx), T, generator=g) > 0.35
            mask[0] = False  # a row without action tokens
            mb = SimpleNamespace(action_mask=mask.long())
            raw = torch.randn(len(idx), T, generator=g, dtype=torch.float64) * 3 - 2
            raw[~mask] = float("nan")  # masked positions hold garbage
            raw[1, 0] = float("-inf")
            mask[1, 2] = mask[2, 3] = True
            raw[1, 2], raw[2, 3] = 5e-324, -1.2345678e-310  # subnormal: the per-value path
            logp = torch.where(mask, raw, torch.zeros_like(raw)).requires_grad_(True)
            scale = torch.randn(len(idx), T, generator=g, dtype=torch.float64)
            scale[torch.rand(len(idx), T, generator=g) < 0.2] = 0.0  # clipped tokens: no gradient
            scale[1, 1] = float("inf")
            (logp * torch.where(mask, scale, torch.zeros_like(scale))).sum().backward()
            adv_kind = (seed + epoch) % 2
            adv = (torch.randn(len(idx), generator=g) if adv_kind else torch.randn(len(idx), T, generator=g) * 1e7)
            adv[0] = 0.0
            old = torch.randn(len(idx), T, generator=g) - 1.0
            old[~mask] = float("nan")
            beh = (torch.randn(len(idx), T, generator=g, dtype=torch.float64) - 1.0) * 1e-5
            ent = torch.rand(len(idx), T, generator=g) * 1e-30
            ent[~mask] = float("inf")
            calls.append((obj, mb, idx, logp, ent if seed % 3 else None, adv, old, beh if seed % 2 else None, epoch))
    return batch, calls


@pytest.mark.parametrize("ratio_source", ["old", "behaviour", "none"])
@pytest.mark.parametrize("rc_mode", [None, "bypass", "decoupled"])
@pytest.mark.parametrize("epochs", [1, 2])
def test_step_record_lines_equal_the_per_value_writer(ratio_source, rc_mode, epochs):
    for seed in range(6):
        batch, calls = _case(seed, ratio_source, rc_mode, epochs)
        rec = StepRecord(batch, step=7, learner_version=3)
        for obj, mb, idx, logp, ent, adv, old, beh, epoch in calls:
            rec.add(obj, mb, idx, logp, ent, adv, old, beh, epoch=epoch)
        got = rec.lines(epochs)
        want = _ref_lines(batch, 7, 3, calls, epochs)
        assert got == want
        parsed = [json.loads(x) for x in got]
        assert [p["episode_id"] for p in parsed] == batch.episode_ids
        assert all(p["n"] == len(p["logp"]) for p in parsed)


def test_the_written_lines_read_back(tmp_path):
    batch, calls = _case(1, "old", "bypass", 1)
    rec = StepRecord(batch, step=1, learner_version=0)
    for obj, mb, idx, logp, ent, adv, old, beh, epoch in calls:
        rec.add(obj, mb, idx, logp, ent, adv, old, beh, epoch=epoch)
    log = tokenlog.TokenLog(tmp_path / "tokens.jsonl", max_bytes=2 ** 20)
    assert log.write(rec.lines(1), 1) == len(batch.episode_ids)
    recs = tokenlog.read_token_log(tmp_path / "tokens.jsonl")
    assert [r["episode_id"] for r in recs] == batch.episode_ids
    assert (tmp_path / "tokens.jsonl").read_bytes() == b"".join(_ref_lines(batch, 1, 0, calls, 1))
