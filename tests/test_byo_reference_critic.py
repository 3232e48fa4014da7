"""The reference and the critic from a path (issue 12, item 1): ``reference.path`` and
``critic.path`` load a checkpoint saved with ``save_pretrained`` (directory or cached hub id,
like ``model.path``), must share the policy's tokenizer, and train 2 steps.

Tiny random Qwen2 checkpoints built in code (tests/_tiny_models.py); nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _tiny_models import family_model, family_tokenizer, save_family_checkpoint  # noqa: E402

from trajgrad.model.learner import learner_logprobs  # noqa: E402
from trajgrad.model.value_head import CriticModel  # noqa: E402
from trajgrad.rollout import collate  # noqa: E402
from trajgrad.train import updates  # noqa: E402
from trajgrad.weights import ReferenceModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ME = __name__


def spread(completions, **kwargs):
    """A reward that differs between samples (distinct characters), so the critic has targets to fit."""
    return [len(set(c)) / 10.0 for c in completions]


def _save_qwen(directory, *, seed, hidden_size=64):
    """A Qwen2 checkpoint of ``hidden_size`` with the shared character tokenizer."""
    tok = family_tokenizer("qwen2")
    family_model("qwen2", tok, seed=seed, hidden_size=hidden_size).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    cfg_file = os.path.join(str(directory), "tokenizer_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    return str(directory)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {"policy": save_family_checkpoint("qwen2", root / "policy", seed=3),
            "other": _save_qwen(root / "other", seed=7),
            "small": _save_qwen(root / "small", seed=5, hidden_size=32),
            "llama": save_family_checkpoint("llama", root / "llama", seed=0)}


def _config(policy, **extra):
    from trajgrad.train.config import load_config

    over = {"model.path": policy, "model.dtype": "float32", "model.lora": None, "train.steps": 2,
            "train.prompts_per_step": 2, "train.group_size": 2, "train.micro_batch_size": 4,
            "sampling.max_new_tokens": 6, "sft.steps": 0, "eval.before": False, "eval.after": False,
            "checkpoint.every": 0, "task.n_train": 8, "task.n_heldout": 2, **extra}
    return load_config(preset="tiny", overrides=over)


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _changed(module, before):
    return [n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])]


def test_reference_from_a_path_is_the_frozen_checkpoint_and_trains_two_steps(ckpts, tmp_path):
    from trajgrad.model.build import build_model
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.trainer import Trainer

    cfg = _config(ckpts["policy"], **{"reference.path": ckpts["other"], "recipe.overrides.kl_placement": "reward",
                                      "recipe.overrides.kl_coef": 0.1})
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    assert isinstance(tr.reference, ReferenceModel)
    ref_before, pol_before = _params(tr.reference), _params(tr.model)
    tr.run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    # pi_ref is another model than the policy: a KL to it from the first step on (a snapshot
    # of the policy would give exactly 0 there)
    assert all(r["kl/k3_to_reference"] > 1e-4 and r["kl/k3_to_reference"] < 1e3 for r in rows)
    assert _changed(tr.model, pol_before) and not _changed(tr.reference, ref_before)
    assert not tr.reference.training and not any(p.requires_grad for p in tr.reference.parameters())

    # the reference log-probs are the checkpoint's own, whatever the policy has become
    trajs = [t for t in map(json.loads, open(tmp_path / "run" / "trajectories.jsonl"))][:3]
    from trajgrad.rollout.trajectory import Trajectory

    batch = collate([Trajectory.from_dict(t) for t in trajs], tr.pad_id)
    direct, _ = build_model(path=ckpts["other"], dtype="float32")
    want = learner_logprobs(direct, batch.input_ids, batch.attention_mask, batch.action_mask,
                            temperature=tr.learner.temperature).logp
    got = updates.reference_logprobs(tr.learner, batch)
    m = batch.action_mask.bool()
    assert m.any() and torch.allclose(got[m], want[m], atol=1e-6, rtol=0)

    # a checkpoint keeps no weights for it; a resumed run loads the same model from its path
    tr.save()
    again = Trainer(cfg, tmp_path / "run", resume=True, console=lambda *_: None)
    assert isinstance(again.reference, ReferenceModel) and again.step == 2
    assert not _changed(again.reference, ref_before)


def test_critic_from_another_checkpoint_trains_its_backbone_and_head(ckpts, tmp_path):
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.trainer import Trainer

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(30)))
    cfg = _config(ckpts["policy"], **{"recipe.name": "ppo", "critic.path": ckpts["small"], "train.group_size": 1,
                                      "train.prompts_per_step": 3, "task.dataset": str(data),
                                      "task.reward": f"{ME}:spread"})
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    critic = tr.value_head
    assert isinstance(critic, CriticModel) and type(critic.backbone).__name__ == "Qwen2ForCausalLM"
    assert critic.head.net[0].in_features == 32 != tr.model.config.hidden_size  # its own width
    assert {id(p) for p in critic.parameters()}.isdisjoint(id(p) for p in tr.model.parameters())
    crit_before, pol_before = _params(critic), _params(tr.model)
    tr.run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["critic/value_loss"])) and r["critic/value_loss"] > 0 for r in rows)
    changed = _changed(critic, crit_before)
    assert any(n.startswith("backbone.model.layers") for n in changed) and any(n.startswith("head.") for n in changed)
    assert _changed(tr.model, pol_before)
    # the values: the head on the critic checkpoint's own final hidden states
    trajs = [json.loads(line) for line in open(tmp_path / "run" / "trajectories.jsonl")][:2]
    from trajgrad.model.learner import head_inputs
    from trajgrad.rollout.trajectory import Trajectory

    batch = collate([Trajectory.from_dict(t) for t in trajs], tr.pad_id)
    with torch.no_grad():
        h, _, _ = head_inputs(critic.backbone, batch.input_ids, batch.attention_mask)
        assert torch.equal(critic(batch), critic.head.net(h).squeeze(-1))
    # ... and differentiable in the backbone (not only moved by weight decay), whose every
    # parameter but the unused LM head is in the critic optimizer, none of the policy's
    held = {id(p) for g in tr.critic_optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in critic.backbone.model.parameters()} <= held
    assert held.isdisjoint(id(p) for p in tr.model.parameters())
    critic.zero_grad(set_to_none=True)
    m = batch.action_mask.bool()
    torch.where(m, critic(batch), 0.0).sum().backward()
    grads = [p.grad for n, p in critic.backbone.named_parameters() if ".layers.0." in n]
    assert grads and all(g is not None for g in grads) and any(float(g.abs().max()) > 0 for g in grads)


def test_reference_and_critic_need_the_policy_tokenizer(ckpts):
    from trajgrad.model.build import build_model
    from trajgrad.train.setup import build_critic, build_reference

    _, tok = build_model(path=ckpts["policy"])
    cfg = _config(ckpts["policy"], **{"reference.path": ckpts["llama"], "recipe.overrides.kl_placement": "loss",
                                      "recipe.overrides.kl_coef": 0.1})
    with pytest.raises(ValueError, match=r"^reference\.path: the tokenizer of .*llama.* another vocabulary"):
        build_reference(cfg, tok)
    cfg = _config(ckpts["policy"], **{"recipe.name": "ppo", "critic.path": ckpts["llama"], "train.group_size": 1})
    with pytest.raises(ValueError, match=r"^critic\.path: the tokenizer of .*llama.* another vocabulary"):
        build_critic(cfg, None, tok)


def test_bad_reference_and_critic_paths_name_their_key(ckpts, tmp_path):
    kl = {"recipe.overrides.kl_placement": "loss", "recipe.overrides.kl_coef": 0.1}
    with pytest.raises(ValueError, match=r"^reference\.path: no such directory .*nowhere"):
        _config(ckpts["policy"], **{"reference.path": str(tmp_path / "nowhere"), **kl})
    with pytest.raises(ValueError, match=r"^reference\.path: 'nobody/no-such-ref'.*local Hugging Face cache"):
        _config(ckpts["policy"], **{"reference.path": "nobody/no-such-ref", **kl})
    with pytest.raises(ValueError, match=r"^critic\.path: no such directory .*nowhere"):
        _config(ckpts["policy"], **{"recipe.name": "ppo", "critic.path": str(tmp_path / "nowhere"),
                                    "train.group_size": 1})
    # set where nothing reads it: refused as having no effect
    with pytest.raises(ValueError, match=r"reference\.path: has no effect: recipe 'grpo' has no reference"):
        _config(ckpts["policy"], **{"reference.path": ckpts["other"]})
    with pytest.raises(ValueError, match=r"critic\.path: has no effect: recipe 'grpo' trains no critic"):
        _config(ckpts["policy"], **{"critic.path": ckpts["small"]})
