"""The trainer end to end on a tiny model: every recipe, resume after SIGKILL, config errors."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from trajgrad.objective import RECIPES
from trajgrad.rollout import read_trajectories
from trajgrad.train import updates
from trajgrad.train.config import build_config, load_config
from trajgrad.train.demos import demo_batch
from trajgrad.train.metrics import read_metrics
from trajgrad.train.trainer import Trainer

TIMING_KEYS = ("time", "wall_time")


GRPO_KL = {"name": "grpo", "overrides": {"kl_placement": "loss", "kl_coef": 0.04}}  # DeepSeekMath's KL term


def micro_config(recipe_name: str, **sections):
    recipe = recipe_name
    group = 2 if RECIPES[recipe].group_size > 1 else None
    data = {
        "name": f"micro-{recipe}",
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        "task": {"name": "calculator", "n_train": 64, "n_heldout": 4,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 2, "min_ops": 1, "max_ops": 1,
                             "max_operand": 9}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "recipe": {"name": recipe},
        "train": {"steps": 2, "prompts_per_step": 2, "group_size": group, "micro_batch_size": 2},
        "sft": {"steps": 1, "batch_size": 4},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 1},
        "log": {"tensorboard": False, "progress": False},
        "teacher": {"name": "tiny", "tiny": {"hidden_size": 32, "layers": 1, "heads": 2, "seed": 5}},
        "dpo": {"pairs": 4},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return build_config(data)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_runs_two_optimizer_steps(recipe, tmp_path):
    torch.manual_seed(0)
    # an untrained model fails every task, so DAPO's dynamic sampling would discard every
    # group (tested separately below); here the update itself is exercised
    extra = {"recipe": {"name": recipe, "overrides": {"dynamic_sampling": False}}} if recipe == "dapo" else {}
    cfg = micro_config(recipe, **extra)
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]), r
    changed = any(not torch.equal(before[n], p.detach()) for n, p in tr.model.named_parameters() if p.requires_grad)
    assert changed, "no parameter moved"
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()
    if recipe != "dpo":
        trajs = read_trajectories(tmp_path / "run" / "trajectories.jsonl")
        assert len(trajs) >= 2 * cfg.train.prompts_per_step
        for t in trajs:  # observation tokens are never trained
            mask = t.action_mask()
            assert sum(mask) == sum(len(turn.action_ids) for turn in t.turns)


def test_ppo_and_sao_log_critic_metrics(tmp_path):
    for recipe in ("ppo", "sao"):
        cfg = micro_config(recipe)
        Trainer(cfg, tmp_path / recipe, console=lambda *_: None).run()
        rows = [r for r in read_metrics(tmp_path / recipe) if r["kind"] == "train"]
        assert all("critic/explained_variance" in r and math.isfinite(r["critic/value_loss"]) for r in rows)


def test_dapo_dynamic_sampling_logs_discarded_groups(tmp_path):
    # an untrained tiny model fails every task: every group has zero variance and is discarded
    cfg = micro_config("dapo", train={"dynamic_sampling_max_tries": 2})
    Trainer(cfg, tmp_path / "run", console=lambda *_: None).run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert sum(r.get("dynamic/discarded_groups", 0) for r in rows) > 0
    logged = read_trajectories(tmp_path / "run" / "trajectories.jsonl")
    discarded = [t for t in logged if t.metadata.get("discarded")]
    assert len(discarded) == 2 * sum(r.get("dynamic/discarded_groups", 0) for r in rows)


def test_micro_batches_do_not_change_the_update(tmp_path):
    """One optimizer step with micro-batches of 1 equals the step with the whole batch (§13)."""
    params = []
    for mb in (1, 8):
        torch.manual_seed(0)
        cfg = micro_config("grpo", train={"steps": 1, "micro_batch_size": mb}, sft={"steps": 0},
                           optim={"grad_clip": None})
        tr = Trainer(cfg, tmp_path / f"mb{mb}", console=lambda *_: None)
        tr.run()
        params.append({n: p.detach().clone() for n, p in tr.model.named_parameters()})
    for n in params[0]:
        assert torch.allclose(params[0][n], params[1][n], atol=1e-6), n


def _strip(rows):
    out = []
    for r in rows:
        out.append({k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith(("time/", "throughput/"))})
    return out


def _run_cli(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "trajgrad", "train", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted_run(tmp_path):
    cfg = micro_config("grpo", train={"steps": 5}, checkpoint={"every": 1}, recipe=GRPO_KL)  # pi_ref resumed too
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump()))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    full = _run_cli([str(cfg_path), "--run-dir", str(tmp_path / "full")], env)
    assert full.wait(timeout=300) == 0, full.stderr.read().decode()[-2000:]

    victim = _run_cli([str(cfg_path), "--run-dir", str(tmp_path / "killed")], env)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        if metrics.exists() and sum(1 for line in metrics.read_text().splitlines() if '"train"' in line) >= 2:
            break
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    resumed = _run_cli(["--resume", str(tmp_path / "killed")], env)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-2000:]

    a = _strip([r for r in read_metrics(tmp_path / "full") if r["kind"] == "train"])
    b = _strip([r for r in read_metrics(tmp_path / "killed") if r["kind"] == "train"])
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            va, vb = ra[k], rb[k]
            if isinstance(va, float):
                assert va == pytest.approx(vb, rel=1e-5, abs=1e-7) or (math.isnan(va) and math.isnan(vb)), (ra["step"], k)
            else:
                assert va == vb, (ra["step"], k)
    ta = [(t.task_id, t.token_ids()) for t in read_trajectories(tmp_path / "full" / "trajectories.jsonl")]
    tb = [(t.task_id, t.token_ids()) for t in read_trajectories(tmp_path / "killed" / "trajectories.jsonl")]
    assert ta == tb  # no duplicate, no missing trajectory


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="train.stpes: unknown key"):
        load_config(preset="tiny", overrides={"train.stpes": 3})
    with pytest.raises(ValueError, match="sampling.top_p"):
        load_config(preset="tiny", overrides={"sampling.top_p": 1.5})
    with pytest.raises(ValueError, match="recipe"):
        load_config(preset="tiny", overrides={"recipe.name": "grpoo"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ValueError, match="config"):
        load_config(bad)


def test_yaml_config_with_preset_base(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("preset: tiny\nrecipe:\n  name: dapo\ntrain:\n  steps: 3\n")
    cfg = load_config(p)
    assert cfg.recipe.name == "dapo" and cfg.train.steps == 3 and cfg.model.name == "tiny"
    assert cfg.objective().eps_high == 0.28


def test_on_policy_old_logp_reuse_equals_a_separate_recompute(tmp_path):
    """old_logp='auto' (the update pass's own detached log-probs) gives the same step as a
    separate no-grad recompute pass: at ratio 1 both are the same estimator."""
    params = []
    for mode in ("auto", "recompute"):
        torch.manual_seed(0)
        cfg = micro_config("dapo", recipe={"name": "dapo", "overrides": {"dynamic_sampling": False}},
                           train={"steps": 1, "old_logp": mode}, sft={"steps": 0})
        tr = Trainer(cfg, tmp_path / mode, console=lambda *_: None)
        tr.run()
        params.append({n: p.detach().clone() for n, p in tr.model.named_parameters()})
    for n in params[0]:
        assert torch.allclose(params[0][n], params[1][n], atol=1e-6), n


def test_evaluation_during_training_uses_during_n_tasks(tmp_path):
    cfg = micro_config("grpo", train={"steps": 2}, sft={"steps": 0},
                       eval={"before": True, "after": True, "every": 1, "during_n": 2})
    Trainer(cfg, tmp_path / "run", console=lambda *_: None).run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"].startswith("eval")]
    assert [(r["kind"], r["eval/n"]) for r in rows] == [("eval_before", 4), ("eval_during", 2), ("eval_after", 4)]


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8.0}], ids=["full", "lora"])
def test_reference_is_the_policy_when_rl_starts(tmp_path, lora):
    """pi_ref is the policy after the SFT warm start, not the model before it (§7, §8)."""
    torch.manual_seed(0)
    # PPO: KL to pi_ref in the reward, so the learner recomputes and logs it every step
    cfg = micro_config("ppo", model={"lora": lora}, sft={"steps": 30, "lr": 1e-2}, critic={"warmup_steps": 0},
                       train={"steps": 2}, checkpoint={"every": 0})
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    initial = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    # step 1 scores with exactly the policy that was snapshotted: KL to pi_ref is 0 (a reference
    # taken before the warm start, or the LoRA base without adapters, would be far from it)
    assert rows[0]["kl/k3_to_reference"] == pytest.approx(0.0, abs=1e-9)
    ref = dict(zip(tr.reference.names, tr.reference.weights))
    assert set(ref) == set(initial)
    assert any(not torch.equal(ref[n], initial[n]) for n in ref)  # SFT moved them: the snapshot is post-SFT
    batch = demo_batch(tr.tokenizer, tr.source, tr.train_tasks[:3], tr.pad_id)
    ref_logp = updates.reference_logprobs(tr.learner, batch)
    with torch.no_grad():  # move the policy: pi_ref must not follow
        gen = torch.Generator().manual_seed(1)
        for p in tr.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    live = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        with tr.reference.applied(tr.model):
            inside = updates.logprobs(tr.learner, batch).logp
            assert all(torch.equal(p, ref[n]) for n, p in tr.model.named_parameters() if n in ref)
        moved = updates.logprobs(tr.learner, batch).logp
    assert all(torch.equal(p, live[n]) for n, p in tr.model.named_parameters() if n in live)  # restored
    torch.testing.assert_close(inside, ref_logp, rtol=0, atol=0)
    torch.testing.assert_close(updates.reference_logprobs(tr.learner, batch), ref_logp, rtol=0, atol=0)
    assert not torch.allclose(moved, ref_logp)


def test_reference_snapshot_survives_a_checkpoint(tmp_path):
    cfg = micro_config("grpo", sft={"steps": 20, "lr": 1e-2}, train={"steps": 2}, checkpoint={"every": 1},
                       recipe=GRPO_KL)
    torch.manual_seed(0)
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    tr.run()
    resumed = Trainer(cfg, tmp_path / "run", resume=True, console=lambda *_: None)
    for a, b in zip(tr.reference.weights, resumed.reference.weights):
        assert torch.equal(a, b)
    from trajgrad.weights import ReferenceWeights

    with pytest.raises(ValueError, match="model: has no trainable parameters"):
        ReferenceWeights(torch.nn.Linear(2, 2).requires_grad_(False))


def test_presets_end_episodes_that_run_out_of_turns_as_failures():
    """A truncated episode bootstraps from the critic (§10); on the calculator task running out
    of turns is a failure, so no preset leaves a critic recipe a stalling exploit."""
    from trajgrad.train.config import PRESETS

    for name in PRESETS:
        cfg = load_config(preset=name)
        if cfg.task.name == "calculator":
            assert cfg.task.options.get("max_turns_terminates") is True, name


# ------------------------------------------------------------------ compacted sub-traces (§19)
def _segment(episode, seg, n_turns, *, terminated=False, compacted=False):
    from trajgrad.rollout import Trajectory, Turn

    turns = [Turn(action_ids=[20 + k, 21 + k, 2], observation_ids=[40, 41] if k < n_turns - 1 else [],
                  behaviour_logp=[-0.5, -0.25, -0.125], reward=0.5 * k) for k in range(n_turns)]
    return Trajectory(task_id="t", episode_id=episode, segment=seg, split="train", prompt_ids=[10, 11, 12 + seg],
                      turns=turns, terminated=terminated, truncated=not (terminated or compacted),
                      metadata={"compacted": compacted})


def _compaction_batch():
    from trajgrad.rollout import collate

    trajs = [_segment("a", 1, 2, terminated=True),       # row 0: a's last sub-trace
             _segment("b", 0, 1),                        # row 1: truncated, alone
             _segment("a", 0, 2, compacted=True),        # row 2: continues in row 0
             _segment("c", 1, 1, compacted=True)]        # row 3: its next sub-trace is not in the batch
    return collate(trajs, pad_id=0)


def test_next_segment_rows_and_bootstrap_values():
    from trajgrad.advantages.credit import bootstrap_values

    batch = _compaction_batch()
    assert batch.next_segment_rows().tolist() == [-1, -1, 0, -1]
    mask = batch.action_mask
    values = torch.randn(mask.shape, dtype=torch.float64)
    values[~mask] = float("nan")  # never read off the action tokens
    boot = bootstrap_values(values, mask, batch.terminated, batch.next_segment_rows())
    pos = torch.arange(mask.shape[1])
    last = [int(pos[m].max()) for m in mask]
    first0 = int(pos[mask[0]].min())
    assert boot[0] == 0.0                                      # terminated
    assert boot[1] == values[1, last[1]]                       # truncated: its own last value
    assert boot[2] == values[0, first0]                        # compacted: the next sub-trace's first state
    assert boot[3] == values[3, last[3]]                       # next sub-trace absent: own last value
    empty = torch.zeros((1, 4), dtype=torch.bool)
    assert bootstrap_values(torch.ones(1, 4, dtype=torch.float64), empty, torch.tensor([False]),
                            torch.tensor([-1])).tolist() == [0.0]


def test_critic_bootstraps_a_compacted_sub_trace_from_the_next_one(tmp_path):
    from trajgrad.advantages.credit import bootstrap_values

    torch.manual_seed(0)
    tr = Trainer(micro_config("ppo", critic={"warmup_steps": 0}), tmp_path / "run", console=lambda *_: None)
    batch = _compaction_batch()
    mask = batch.action_mask
    B, L = mask.shape
    hidden = torch.randn(B, L, tr.value_head.net[0].in_features)
    tok_r = torch.zeros(B, L, dtype=torch.float64)
    tok_r[mask] = 0.3
    adv, _ = updates.critic_update(tr.learner, batch, hidden, tok_r)
    with torch.no_grad():
        nv = tr.value_head(hidden).double()
    pos = torch.arange(L)[None].expand(B, L)
    last = torch.where(mask, pos, -1).max(1).values
    terminated = torch.zeros(B, L, dtype=torch.bool)
    terminated[torch.arange(B), last] = batch.terminated
    expect = tr.objective.token_advantages(nv, tok_r, mask, terminated=terminated,
                                           bootstrap_value=bootstrap_values(nv, mask, batch.terminated,
                                                                            batch.next_segment_rows())).advantages
    torch.testing.assert_close(adv[mask], expect[mask], rtol=0, atol=1e-10)
    # the compacted row's advantages depend on where it bootstraps from
    own = bootstrap_values(nv, mask, batch.terminated, torch.full((B,), -1))
    alt = tr.objective.token_advantages(nv, tok_r, mask, terminated=terminated, bootstrap_value=own).advantages
    assert not torch.allclose(adv[2][mask[2]], alt[2][mask[2]])
    torch.testing.assert_close(adv[1][mask[1]], alt[1][mask[1]], rtol=0, atol=1e-10)


def test_overriding_the_recipe_renames_the_run():
    assert load_config(preset="tiny").name == "tiny-calculator-grpo"
    assert load_config(preset="tiny", overrides={"recipe.name": "ppo"}).name == "tiny-calculator-ppo"
    assert load_config(preset="tiny", overrides={"recipe.name": "ppo", "name": "mine"}).name == "mine"
    assert load_config(preset="tiny", overrides={"recipe.name": "grpo"}).name == "tiny-calculator-grpo"
    # in a YAML file on a preset base as well
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text("preset: tiny\nrecipe: {name: rloo}\n")
        assert load_config(path).name == "tiny-calculator-rloo"
        path.write_text("preset: tiny\nname: keep\nrecipe: {name: rloo}\n")
        assert load_config(path).name == "keep"


def test_one_demonstration_trajectory_feeds_sft_and_dpo(tmp_path):
    """SFT and DPO's chosen responses use rollout.chat.demonstration_trajectory: tokens no
    policy sampled (version -1 at every action target), no reward, success True."""
    from trajgrad.rollout import chat
    from trajgrad.train import demos

    assert demos.demonstration_trajectory is chat.demonstration_trajectory
    tr = Trainer(micro_config("dpo"), tmp_path / "run", console=lambda *_: None)
    tasks = tr.train_tasks[:3]
    batch = demo_batch(tr.tokenizer, tr.source, tasks, tr.pad_id)
    expect = [chat.demonstration_trajectory(tr.tokenizer, tr.source, t) for t in tasks]
    assert batch.episode_ids == [t.episode_id for t in expect]
    assert (batch.policy_version[batch.action_mask] == -1).all()
    assert batch.success.all() and float(batch.rewards.abs().sum()) == 0.0
    assert batch.action_mask.sum(1).tolist() == [t.num_action_tokens for t in expect]
    samples = [t for t in tr.sampler.rollout(tr.source, tasks, group_size=2, seed=0) if not t.success]
    pairs = demos.build_dpo_pairs(tr.tokenizer, tr.source, tasks, samples)
    assert all(c.metadata["demonstration"] and not r.success for c, r in pairs)
    step = demos.pairs_for_step(pairs, cursor=1, per_step=2)
    assert len(step) == min(2, len(pairs))


def test_entropy_bonus_reaches_the_loss_with_its_gradient(tmp_path):
    """entropy_coef > 0: the policy loss gets the exact per-token entropy of the sampling
    distribution with its gradient, through the chunked head ([B, L, V] never held); value
    and gradient against the entropy of the full logits by autograd."""
    torch.manual_seed(0)
    cfg = micro_config("grpo", recipe={"name": "grpo", "overrides": {"entropy_coef": 0.05}}, sft={"steps": 0},
                       sampling={"temperature": 0.7, "max_new_tokens": 8})
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    batch = demo_batch(tr.tokenizer, tr.source, tr.train_tasks[:1], tr.pad_id)
    mask = batch.action_mask
    params = [p for p in tr.model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    lp, ent = updates.logprobs_with_entropy(tr.learner, batch)
    assert ent.requires_grad and lp.requires_grad
    g_fused = torch.autograd.grad((torch.where(mask, ent * w, 0.0)).sum() + lp.sum(), params)
    logits = tr.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].double() / 0.7
    logp_all = torch.log_softmax(logits, -1)
    ent_ref = -(logp_all.exp() * logp_all).sum(-1)
    lp_ref = torch.where(mask, logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1), 0.0)
    g_ref = torch.autograd.grad((torch.where(mask, ent_ref * w, 0.0)).sum() + lp_ref.sum(), params)
    torch.testing.assert_close(ent[mask], ent_ref[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp[mask], lp_ref[mask], rtol=1e-5, atol=1e-5)
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)
    # a training step puts the bonus into the loss (and logs the term)
    tr.run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert all(math.isfinite(r["entropy_bonus_term"]) and r["entropy_bonus_term"] > 0 for r in rows)
    # top-k sampling: the bonus would need the truncated distribution's entropy; refused
    tr.learner.top_k = 5
    with pytest.raises(ValueError, match="^entropy_coef"):
        updates.logprobs_with_entropy(tr.learner, batch)
