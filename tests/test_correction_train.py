"""Rollout correction through the trainer: three log-prob sources, both modes, every token
recipe, metrics per step and per turn, the mismatch-injection setting, config errors."""
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from trajgrad.objective import RECIPES
from trajgrad.rollout import collate
from trajgrad.train import update_metrics, updates
from trajgrad.train.config import build_config, load_config, parse_overrides
from trajgrad.train.metrics import read_metrics
from trajgrad.train.trainer import Trainer

QUIET = dict(console=lambda *_: None)
TOKEN_RECIPES = sorted(n for n, o in RECIPES.items() if o.kind == "token")

SETTINGS = {
    "tis_token": {"kind": "tis", "level": "token", "cap": 1.5},
    "tis_sequence": {"kind": "tis", "level": "sequence", "cap": 2.0},
    "mis_token": {"kind": "mis", "level": "token", "bounds": [0.8, 1.25]},
    "mis_sequence": {"kind": "mis", "level": "sequence", "bounds": [0.2, 5.0]},
    "mis_geometric_bypass": {"kind": "mis", "level": "geometric", "bounds": [0.9, 1.1], "mode": "bypass"},
    "mis_token_bypass": {"kind": "mis", "level": "token", "bounds": [0.8, 1.25], "mode": "bypass"},
    "reject_k3": {"kind": "none", "reject": "k3", "reject_threshold": 0.05, "reject_level": "token"},
    "seq_mask": {"kind": "none", "seq_mask_delta": 0.0, "mode": "bypass"},
}


def micro(recipe="grpo", correction=None, *, behaviour_temperature=1.6, **sections):
    group = 2 if RECIPES[recipe].group_size > 1 else None
    overrides = {"dynamic_sampling": False} if RECIPES[recipe].dynamic_sampling else {}
    if correction is not None:
        overrides["rollout_correction"] = correction
    data = {
        "name": "micro-correction",
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        "task": {"name": "calculator", "n_train": 64, "n_heldout": 4,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 2, "min_ops": 1, "max_ops": 1,
                             "max_operand": 9}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "behaviour_temperature": behaviour_temperature},
        "recipe": {"name": recipe, "overrides": overrides},
        "train": {"steps": 2, "prompts_per_step": 2, "group_size": group, "micro_batch_size": 2},
        "sft": {"steps": 0},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": False},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return build_config(data)


def _train_rows(run_dir):
    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------- two steps, each mode and kind
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_two_steps_with_each_mode_and_kind_log_finite_metrics(name, tmp_path):
    torch.manual_seed(0)
    cfg = micro("grpo", SETTINGS[name])
    tr = Trainer(cfg, tmp_path / "run", **QUIET)
    tr.run()
    rows = _train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("weight/mean", "weight/min", "weight/max", "ess", "truncated_frac", "masked_frac",
                    "rejected_frac", "seq_masked_frac", "kept_frac", "kl/k1", "kl/k3"):
            assert math.isfinite(r[f"correction/{key}"]), (key, r)
        turns = sorted({k.split("/")[1] for k in r if k.startswith("correction/turn")})
        assert turns and turns[0] == "turn0", r
        for t in turns:
            for key in ("weight/mean", "weight/min", "weight/max", "ess", "kept_frac", "dropped_frac", "kl/k1", "kl/k3",
                        "truncated_frac", "masked_frac", "rejected_frac", "seq_masked_frac"):
                assert math.isfinite(r[f"correction/{t}/{key}"]), (t, key)
            # the sampler-learner mismatch per turn, with or without a correction
            assert r[f"mismatch/{t}/kl_k3"] > 0 and math.isfinite(r[f"mismatch/{t}/kl_k1"]), t
        assert math.isfinite(r["loss"])
        # the sampler drew at 1.6, the learner assumes 1.0: the mismatch is there and measured
        assert r["correction/kl/k3"] > 1e-5
        assert r["correction/weight/min"] <= r["correction/weight/mean"] <= r["correction/weight/max"]


@pytest.mark.parametrize("recipe", TOKEN_RECIPES)
def test_every_token_recipe_trains_two_steps_with_a_correction(recipe, tmp_path):
    # a term whose ratio is already against the behaviour log-probs (sao) takes bypass mode
    rc = {"kind": "mis", "level": "token", "bounds": [0.5, 2.0],
          "mode": "bypass" if RECIPES[recipe].ratio_source == "behaviour" else "decoupled"}
    torch.manual_seed(0)
    tr = Trainer(micro(recipe, rc), tmp_path / "run", **QUIET)
    tr.run()
    rows = _train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["correction/weight/mean"]), r
        assert r["correction/kl/k1"] != 0.0


# ---------------------------------------------------------------------- no mismatch: weight 1, same update
def _batch_and_advantages(tr):
    trajs, _ = tr._collect()
    batch = collate(trajs, tr.pad_id)
    seq_r = batch.rewards.double()
    adv = tr.objective.sequence_advantages(seq_r, group_ids=batch.group_ids).advantages.double()
    if float(adv.abs().sum()) == 0:  # an untrained model may fail every task: give the update a signal
        adv = torch.linspace(-1.0, 1.0, len(batch), dtype=torch.float64)
    return batch, adv


def _reference(st, batch):
    return updates.reference_logprobs(st, batch).double() if st.objective.kl_placement != "none" else None


@pytest.mark.parametrize("setting", ["tis_token", "tis_sequence", "mis_token", "mis_geometric_bypass"])
@pytest.mark.parametrize("fused", [True, False], ids=["auto_old", "recomputed_old"])
def test_without_mismatch_weights_are_one_and_the_update_is_the_uncorrected_one(setting, fused, tmp_path):
    torch.manual_seed(0)
    # one micro-batch holding the whole batch: the update pass computes exactly the recompute's numbers
    cfg = micro("grpo", None, behaviour_temperature=None, train={"micro_batch_size": 64})
    tr = Trainer(cfg, tmp_path / "run", **QUIET)
    st = tr.learner
    batch, adv = _batch_and_advantages(tr)
    mask = batch.action_mask
    with torch.no_grad():
        old = updates.logprobs(st, batch).logp.double()
    # behaviour == old exactly (the ratio pi_old/mu is 1 at every token)
    behaviour_logp = torch.where(mask, old, 0.0)
    old_logp = None if fused else old
    ref = _reference(st, batch)
    model0, opt0 = copy.deepcopy(st.model.state_dict()), copy.deepcopy(st.optimizer.state_dict())
    base_obj = st.objective
    out = {}
    for label, rc in (("plain", None), ("corrected", SETTINGS[setting])):
        st.model.load_state_dict(model0)
        st.optimizer.load_state_dict(opt0)
        st.objective = base_obj if rc is None else base_obj.replace(rollout_correction=rc)
        m = updates.policy_update(st, batch, adv, old_logp, ref, behaviour=torch.where(mask, old, float("nan")),
                                  behaviour_logp=behaviour_logp)
        out[label] = (m, _params(st.model))
    m = out["corrected"][0]
    assert m["correction/weight/mean"] == 1.0 and m["correction/weight/min"] == 1.0 and m["correction/weight/max"] == 1.0
    assert m["correction/kept_frac"] == 1.0 and m["correction/kl/k1"] == 0.0 and m["correction/kl/k3"] == 0.0
    assert m["correction/turn0/weight/mean"] == 1.0 and m["correction/turn0/dropped_frac"] == 0.0
    assert m["loss"] == out["plain"][0]["loss"]
    for n, p in out["plain"][1].items():
        assert torch.equal(p, out["corrected"][1][n]), n


# ---------------------------------------------------------------------- the three sources, "auto" old
def test_auto_old_logprobs_still_give_the_correction_the_behaviour_logprobs(tmp_path):
    """With one on-policy epoch the update pass's own log-probs are the old ones ("auto"); the
    correction must see the sampler's log-probs all the same: the step equals the one with a
    separate recompute pass, and the weights are not 1."""
    rows, params = {}, {}
    for mode in ("auto", "recompute"):
        torch.manual_seed(0)
        # the tiny model's distributions are nearly flat: pi_old / mu stays within about 10% of 1,
        # so a cap just above 1 is what some tokens of the batch exceed
        cfg = micro("grpo", {"kind": "tis", "cap": 1.02}, train={"steps": 1, "old_logp": mode}, optim={"grad_clip": None})
        tr = Trainer(cfg, tmp_path / mode, **QUIET)
        tr.run()
        rows[mode] = _train_rows(tmp_path / mode)[0]
        params[mode] = _params(tr.model)
    for n in params["auto"]:
        assert torch.allclose(params["auto"][n], params["recompute"][n], atol=1e-6), n
    for key in ("correction/weight/mean", "correction/kl/k1", "correction/truncated_frac"):
        assert rows["auto"][key] == pytest.approx(rows["recompute"][key], abs=1e-6), key
    for mode in ("auto", "recompute"):  # the mismatch logged with or without correction is the correction's
        assert rows[mode]["mismatch/kl_k1"] == pytest.approx(rows[mode]["correction/kl/k1"], rel=1e-9, abs=1e-12)
        assert rows[mode]["mismatch/kl_k3"] == pytest.approx(rows[mode]["correction/kl/k3"], rel=1e-9, abs=1e-12)
    assert rows["auto"]["correction/weight/mean"] != 1.0
    assert rows["auto"]["correction/weight/max"] == pytest.approx(1.02)  # tokens with pi_old/mu > 1.02 are capped
    assert rows["auto"]["correction/truncated_frac"] > 0


def decoupled_step(tmp_path):
    """A two-epoch GRPO learner, one collected batch, its advantages, the recomputed π_old and the
    behaviour log-probs (0 at masked positions)."""
    torch.manual_seed(0)
    cfg = micro("grpo", None, train={"epochs_per_batch": 2, "old_logp": "recompute"})
    tr = Trainer(cfg, tmp_path / "run", **QUIET)
    st = tr.learner
    batch, adv = _batch_and_advantages(tr)
    with torch.no_grad():
        old = updates.logprobs(st, batch).logp.double()
    return st, batch, adv, old, torch.where(batch.action_mask, batch.old_logp.double(), 0.0)


def test_decoupled_correction_takes_the_recomputed_old_logprobs_over_every_epoch(tmp_path):
    """Decoupled: rho = pi_old/mu with pi_old recomputed before the update and fixed over the
    epochs; the step's correction metrics equal those of the tensors by hand."""
    st, batch, adv, old, beh = decoupled_step(tmp_path)
    mask = batch.action_mask
    z = torch.where(mask, old - beh, 0.0)
    n = mask.sum()
    st.objective = st.objective.replace(rollout_correction=SETTINGS["tis_token"])
    ref = _reference(st, batch)
    m = updates.policy_update(st, batch, adv, old, ref, behaviour=batch.old_logp.double(), behaviour_logp=beh)
    assert m["correction/kl/k1"] == pytest.approx(float(-z.sum() / n), rel=1e-9)
    w = torch.exp(torch.clamp(z, max=math.log(1.5)))
    assert m["correction/weight/mean"] == pytest.approx(float(torch.where(mask, w, 0.0).sum() / n), rel=1e-9)
    with pytest.raises(ValueError, match="behaviour_logp"):
        updates.policy_update(st, batch, adv, old, ref, behaviour_logp=None)


def test_stale_trajectories_are_corrected_like_the_asynchronous_learner_does(tmp_path):
    """The asynchronous learners call Trainer.learn on trajectories sampled by older policy
    versions: behaviour (old version, sampler) != old (current weights, recomputed)."""
    torch.manual_seed(0)
    # single-rollout reinforce, as the asynchronous learner trains it; the entropy bonus moves the
    # policy even when every reward is 0 (an untrained model)
    rc = dict(SETTINGS["tis_token"])
    cfg = build_config({**micro("reinforce", rc, behaviour_temperature=None).model_dump(),
                        "recipe": {"name": "reinforce", "overrides": {"rollout_correction": rc, "entropy_coef": 0.5}},
                        "optim": {"lr": 5e-2}})
    tr = Trainer(cfg, tmp_path / "run", **QUIET)
    stale, _ = tr._collect()
    fresh, _ = tr._collect()
    m0 = tr.learn(fresh)  # moves the policy: `stale` is now one version behind
    assert m0["correction/kl/k3"] < 1e-6  # same weights, same temperature: no mismatch
    m1 = tr.learn(stale)
    assert all(t.turns[0].policy_version == 0 for t in stale) and tr.policy_version == 2
    assert m1["correction/kl/k3"] > 1e-4 and m1["correction/weight/mean"] != 1.0


# ---------------------------------------------------------------------- per-turn metrics by hand
def test_per_turn_metrics_restrict_the_step_metric_to_each_turns_tokens():
    torch.manual_seed(3)
    B, L = 3, 7
    mask = torch.rand(B, L) < 0.7
    mask[:, 0] = True
    turn_ids = torch.randint(0, 3, (B, L))
    beh = torch.randn(B, L, dtype=torch.float64) - 1.0
    tgt = beh + 0.8 * torch.randn(B, L, dtype=torch.float64)
    beh = torch.where(mask, beh, torch.full_like(beh, float("nan")))  # NaN off the action tokens
    tgt = torch.where(mask, tgt, torch.full_like(tgt, float("inf")))
    obj = RECIPES["grpo"].replace(rollout_correction={"kind": "tis", "cap": 1.3})
    batch = SimpleNamespace(action_mask=mask, turn_ids=turn_ids)
    m = update_metrics.correction_metrics(obj, batch, beh, tgt)
    z = torch.where(mask, tgt - beh, 0.0)
    w = torch.exp(torch.clamp(z, max=math.log(1.3)))
    for k in torch.unique(turn_ids[mask]).tolist():
        sel = mask & (turn_ids == k)
        ws, zs = w[sel], z[sel]
        p = f"correction/turn{k}/"
        assert m[p + "weight/mean"] == pytest.approx(float(ws.mean()))
        assert m[p + "weight/max"] == pytest.approx(float(ws.max()))
        assert m[p + "truncated_frac"] == pytest.approx(float((zs > math.log(1.3)).double().mean()))
        assert m[p + "kl/k1"] == pytest.approx(float(-zs.mean()))
        assert m[p + "kl/k3"] == pytest.approx(float((torch.exp(zs) - 1 - zs).mean()))
        assert m[p + "ess"] == pytest.approx(float(ws.sum() ** 2 / (ws * ws).sum() / sel.sum()))
    assert all(math.isfinite(v) for v in m.values())
    assert m["correction/weight/mean"] == pytest.approx(float(w[mask].mean()))


# ---------------------------------------------------------------------- the mismatch-injection setting
def test_behaviour_temperature_samples_under_another_distribution(tmp_path):
    torch.manual_seed(0)
    tr = Trainer(micro("grpo", None, behaviour_temperature=2.5), tmp_path / "a", **QUIET)
    assert tr.sampler.temperature == 2.5 and tr.learner.temperature == 1.0
    trajs, _ = tr._collect()
    batch = collate(trajs, tr.pad_id)
    mask = batch.action_mask
    with torch.no_grad():
        learner = updates.logprobs(tr.learner, batch).logp.double()
        at_sampler_t = updates.logprobs(SimpleNamespace(**{**tr.learner.__dict__, "temperature": 2.5}), batch).logp
    # the records are exact log-probs of the temperature-2.5 distribution, not of the learner's
    rec = batch.old_logp.double()
    assert torch.allclose(rec[mask], at_sampler_t.double()[mask], atol=1e-4)
    assert float((learner - torch.nan_to_num(rec)).abs()[mask].max()) > 0.1
    # without the setting the sampler draws at the learner's temperature
    tr2 = Trainer(micro("grpo", None, behaviour_temperature=None), tmp_path / "b", **QUIET)
    assert tr2.sampler.temperature == tr2.learner.temperature == 1.0


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize("sets, key", [
    (["recipe.overrides.rollout_correction.kind=foo"], "recipe.overrides.rollout_correction.kind"),
    (["recipe.overrides.rollout_correction.cap=-1"], "recipe.overrides.rollout_correction.cap"),
    (["recipe.overrides.rollout_correction.cap='2'"], "recipe.overrides.rollout_correction.cap"),
    (["recipe.overrides.rollout_correction.capp=2"], "recipe.overrides.rollout_correction.capp"),
    (["recipe.overrides.rollout_correction={kind: mis, bounds: [2, 1]}"], "recipe.overrides.rollout_correction.bounds"),
    (["recipe.overrides.rollout_correction.kind=tis", "recipe.overrides.rollout_correction.mode=bypass"],
     "recipe.overrides.rollout_correction.mode"),
    (["recipe.overrides.rollout_correction.kind=tis", "train.old_logp=behaviour"], "train.old_logp"),
    (["sampling.behaviour_temperature=0"], "sampling.behaviour_temperature"),
    (["recipe.name=dpo", "recipe.overrides.rollout_correction.kind=tis"], "recipe.overrides"),
])
def test_config_errors_name_the_dotted_key(sets, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(preset="tiny", overrides=parse_overrides(sets))


def test_config_accepts_the_correction_from_yaml_and_set(tmp_path):
    cfg = load_config(preset="tiny", overrides=parse_overrides(
        ["recipe.overrides.rollout_correction.kind=mis", "recipe.overrides.rollout_correction.bounds=[0.5, 2]",
         "recipe.overrides.rollout_correction.mode=bypass", "sampling.behaviour_temperature=1.0"]))
    rc = cfg.objective().rollout_correction
    assert (rc.kind, rc.bounds, rc.mode) == ("mis", (0.5, 2.0), "bypass")
    assert cfg.sampling.sampler_temperature == 1.0 and cfg.sampling.temperature == 0.7
    p = tmp_path / "c.yaml"
    p.write_text("preset: tiny\nrecipe:\n  name: grpo\n  overrides:\n    rollout_correction:\n"
                 "      kind: tis\n      level: sequence\n      cap: 3\n")
    rc = load_config(p).objective().rollout_correction
    assert (rc.kind, rc.level, rc.cap, rc.mode) == ("tis", "sequence", 3, "decoupled")


# ---------------------------------------------------------------------- the asynchronous learner on Ray
@pytest.mark.slow
@pytest.mark.parametrize("recipe, rc", [
    ("sao", {"kind": "mis", "level": "token", "bounds": [0.5, 2.0], "mode": "bypass"}),
    ("ppo", {"kind": "tis", "level": "token", "cap": 2.0}),
])
def test_async_learner_corrects_its_updates(recipe, rc, tmp_path):
    """AsyncTrainer on Ray workers that sample at behaviour_temperature: the workers' records
    reach the correction (lag and temperature mismatch both show in its KL), per turn too."""
    ray = pytest.importorskip("ray")
    from trajgrad.train.asynchronous import AsyncTrainer

    cfg = build_config({
        "name": "async-correction",
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        "task": {"name": "calculator", "n_train": 64, "n_heldout": 4,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 2, "min_ops": 1, "max_ops": 1,
                             "max_operand": 9}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "behaviour_temperature": 1.6},
        "recipe": {"name": recipe, "overrides": {"rollout_correction": rc}},
        "train": {"steps": 2, "prompts_per_step": 1, "micro_batch_size": 4},
        "critic": {"warmup_steps": 0},
        "sft": {"steps": 0},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": False},
        "asynchronous": {"enabled": True, "workers": 1, "max_lag": 2, "batch_trajectories": 4, "queue_size": 2},
    })
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        AsyncTrainer(cfg, tmp_path / "run", **QUIET).run(stall_timeout=120)
    finally:
        ray.shutdown()
    rows = _train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"])
        assert r["correction/kl/k3"] > 1e-5 and math.isfinite(r["correction/turn0/weight/mean"])
