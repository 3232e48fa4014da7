"""collate() builds each field with one tensor conversion; every field equals the row by row
formulation (a row's views written into a padded tensor), dtype, NaN padding and all."""
import random

import pytest
import torch

from trajgrad.rollout import Trajectory, Turn, collate


def _row_by_row(trajs, pad_id, dtype, multiple):
    T = max(len(t) for t in trajs)
    if multiple:
        T = -(-T // multiple) * multiple
    K = max(len(t.turns) for t in trajs)
    B = len(trajs)
    out = {"input_ids": torch.full((B, T), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros((B, T), dtype=torch.long),
           "action_mask": torch.zeros((B, T - 1), dtype=torch.bool),
           "old_logp": torch.full((B, T - 1), float("nan"), dtype=dtype),
           "policy_version": torch.full((B, T - 1), -1, dtype=torch.long),
           "turn_ids": torch.zeros((B, T - 1), dtype=torch.long)}
    for key in ("turn_rewards", "turn_costs", "turn_potentials"):
        out[key] = torch.zeros((B, K), dtype=dtype)
    out["turn_mask"] = torch.zeros((B, K), dtype=torch.bool)
    for b, t in enumerate(trajs):
        seq = t.token_ids()
        for j, x in enumerate(seq):
            out["input_ids"][b, j] = x
            out["attention_mask"][b, j] = 1
        views = zip(t.action_mask(), t.behaviour_logp_aligned(), t.policy_versions_aligned(), t.turn_ids_aligned())
        for j, (m, lp, v, k) in enumerate(views):
            out["action_mask"][b, j] = bool(m)
            out["old_logp"][b, j] = torch.tensor(lp, dtype=torch.float64).to(dtype)
            out["policy_version"][b, j] = v
            out["turn_ids"][b, j] = k
        for k, turn in enumerate(t.turns):
            out["turn_rewards"][b, k] = torch.tensor(turn.reward, dtype=torch.float64).to(dtype)
            out["turn_costs"][b, k] = torch.tensor(float(turn.info.get("cost", 0.0)), dtype=torch.float64).to(dtype)
            out["turn_potentials"][b, k] = torch.tensor(float(turn.info.get("potential", 0.0)),
                                                        dtype=torch.float64).to(dtype)
            out["turn_mask"][b, k] = True
    return out


def _random_trajectory(rng, i):
    turns = []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, 7)
        info = {}
        if rng.random() < 0.5:
            info["cost"] = rng.uniform(0, 2)
        if rng.random() < 0.5:
            info["potential"] = rng.choice([rng.uniform(-1, 1), 1e-40, 3])
        turns.append(Turn(action_ids=[rng.randint(0, 300) for _ in range(n)],
                          observation_ids=[rng.randint(0, 300) for _ in range(rng.randint(0, 5))],
                          behaviour_logp=[-rng.random() * 10 ** rng.uniform(-9, 2) for _ in range(n)],
                          policy_version=rng.randint(0, 5), reward=rng.uniform(-1, 1) * 10 ** rng.randint(-40, 3),
                          info=info))
    return Trajectory(task_id=f"task-{rng.randint(0, 3)}", episode_id=f"ep-{i}",
                      prompt_ids=[rng.randint(0, 300) for _ in range(rng.randint(1, 8))], turns=turns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("multiple", [None, 8])
def test_collate_equals_the_row_by_row_formulation(dtype, multiple):
    rng = random.Random(f"{dtype}-{multiple}")
    for trial in range(25):
        trajs = [_random_trajectory(rng, i) for i in range(rng.randint(1, 6))]
        pad = rng.randint(0, 9)
        got = collate(trajs, pad_id=pad, dtype=dtype, pad_to_multiple_of=multiple)
        for key, want in _row_by_row(trajs, pad, dtype, multiple).items():
            g = getattr(got, key)
            assert g.dtype == want.dtype and g.shape == want.shape, key
            if g.is_floating_point():
                assert torch.equal(torch.isnan(g), torch.isnan(want)), key
                g, want = torch.nan_to_num(g), torch.nan_to_num(want)
            assert torch.equal(g, want), key
        assert torch.equal(got.position_ids, torch.cumsum(got.attention_mask, 1).sub(1).clamp(min=0)
                           * got.attention_mask)
