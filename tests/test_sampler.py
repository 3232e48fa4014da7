"""HFSampler: exact behaviour log-probs (§7, §24), multi-turn assembly (§4), policy
versions (§16), compaction (§19), and the ChatML observation tokens."""
from __future__ import annotations

import math

import pytest
import torch

from trajgrad.envs.base import StepResult, Task
from trajgrad.logprobs import token_logprobs
from trajgrad.rollout import HFSampler, Trajectory, collate
from trajgrad.rollout.chat import (
    decode_action,
    demonstration_trajectory,
    end_of_turn_id,
    observation_ids,
    observation_text,
    prompt_ids,
)
from trajgrad.model.tiny import build_tiny_model
from trajgrad.rollout.generation import sample_actions

SYSTEM = {"role": "system", "content": "You are a test."}


class FakeEnv:
    """A deterministic multi-turn environment implementing the Environment protocol.

    Every step answers with one user message quoting the action's length; rewards are
    0.5 * step index. ``stop_after`` terminates (success) after that many steps;
    ``compact_at`` asks for compaction at that step; ``on_step`` is called with the
    step index (used to change the policy version between turns).
    """

    name = "fake"

    def __init__(self, max_turns=3, stop_after=None, compact_at=None, on_step=None, truncate_at=None):
        self.max_turns = max_turns
        self.stop_after = stop_after
        self.compact_at = compact_at
        self.on_step = on_step
        self.truncate_at = truncate_at
        self.history = []
        self.t = 0

    def reset(self, task):
        self.t = 0
        self.history = [SYSTEM, {"role": "user", "content": task.prompt}]
        return list(self.history)

    def step(self, action_text):
        self.t += 1
        self.history.append({"role": "assistant", "content": action_text})
        if self.on_step is not None:
            self.on_step(self.t)
        info = {"potential": float(self.t), "cost": 0.25 * self.t}
        if self.stop_after is not None and self.t >= self.stop_after:
            info["success"] = True
            return StepResult([], 1.0, True, False, info)
        if self.truncate_at is not None and self.t >= self.truncate_at:
            return StepResult([], 0.0, False, True, info)
        if self.compact_at == self.t:
            info["compact"] = f"summary after {self.t}"
        msgs = [{"role": "user", "content": f"<result>{len(action_text)}</result>"}]
        self.history.extend(msgs)
        return StepResult(msgs, 0.5 * self.t, False, False, info)

    def potential(self):
        return float(self.t)


class Recorder:
    """An env factory that keeps the environments it made."""

    def __init__(self, **kw):
        self.kw = kw
        self.envs = []

    def make_env(self, **kw):
        env = FakeEnv(**{**self.kw, **kw})
        self.envs.append(env)
        return env


def tasks(n=3):
    return [Task(id=f"t{i}", split="train", prompt="q" * (1 + 5 * i), answer=i) for i in range(n)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, hidden_size=64, layers=2, heads=4, seed=0)


def learner_logp(model, batch, **sampling):
    """The learner's recomputation: one forward pass on the right-padded batch with
    position ids from the attention mask, then token_logprobs with the same settings."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, :-1]
    return token_logprobs(logits, batch.targets, mask=batch.action_mask, return_support=True, **sampling)


# ----------------------------------------------------------------------------- §24 / §7
@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=20)],
    ids=["T1", "T0.7-p0.9", "T1.3-k20"],
)
def test_learner_recomputes_behaviour_logp(tok, model, sampling):
    """No update between sampling and learning: ratio == 1 on every action token."""
    src = Recorder(max_turns=3)
    sampler = HFSampler(model, tok, max_new_tokens=10, **sampling)
    trajs = sampler.rollout(src, tasks(3), group_size=2, seed=1)
    assert len(trajs) == 6 and all(len(t.turns) == 3 for t in trajs)
    batch = collate(trajs, tok.pad_token_id)
    logp, in_support = learner_logp(model, batch, **sampling)
    m = batch.action_mask
    assert in_support.all()
    ratio = torch.exp(logp - batch.old_logp)[m]
    assert ratio.numel() == sum(t.num_action_tokens for t in trajs) > 100
    assert (ratio - 1).abs().max().item() < 1e-5
    # the check can fail: the same learner without the sampler's truncation/temperature
    wrong = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].detach(),
                           batch.targets, mask=m)
    assert sampling == dict(temperature=1.0) or (wrong - batch.old_logp)[m].abs().max().item() > 1e-3
    for t in trajs:
        assert t.sampling["temperature"] == sampling["temperature"]
        assert t.sampling["top_k"] == sampling.get("top_k") and t.sampling["top_p"] == sampling.get("top_p")
        assert t.sampling["max_new_tokens"] == 10 and t.sampling["seed"] == 1
        assert t.sampling["model"] == model.config._name_or_path


def test_exact_logp_with_long_actions_and_ragged_lengths(tok, model):
    """Actions that end at different steps (rows pruned from the KV cache) and prompts of
    very different lengths (heavy left padding) still give ratio 1."""
    src = Recorder(max_turns=2)
    ts = [Task(id=f"r{i}", split="train", prompt="x" * n, answer=0) for i, n in enumerate([1, 40, 90])]
    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=150)
    trajs = sampler.rollout(src, ts, group_size=2, seed=3)
    lengths = {len(turn.action_ids) for t in trajs for turn in t.turns}
    assert len(lengths) > 3  # actions ended at many different steps
    assert any(turn.action_ids[-1] == sampler.eos_id for t in trajs for turn in t.turns)
    batch = collate(trajs, tok.pad_token_id)
    logp, in_support = learner_logp(model, batch, temperature=1.0)
    ratio = torch.exp(logp - batch.old_logp)[batch.action_mask]
    assert in_support.all() and (ratio - 1).abs().max().item() < 1e-5


def test_left_padding_does_not_change_the_distribution(tok, model):
    """Greedy continuation of a sequence alone equals its continuation inside a batch
    with longer (left-padding) neighbours: positions come from the attention mask."""
    eos = end_of_turn_id(tok)
    seqs = [prompt_ids(tok, [{"role": "user", "content": "a" * n}]) for n in (2, 30, 77)]
    alone = [sample_actions(model, [s], eos_ids=[eos], pad_id=0, temperature=0.0, max_new_tokens=12)[0] for s in seqs]
    together = sample_actions(model, seqs, eos_ids=[eos], pad_id=0, temperature=0.0, max_new_tokens=12)
    assert [a[0] for a in alone] == [b[0] for b in together]
    # and the greedy token is the learner's argmax at every action position
    batch = collate([Trajectory(task_id="g", episode_id=str(i), prompt_ids=s,
                                turns=[_turn(a)]) for i, (s, a) in enumerate(zip(seqs, together))], 0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    assert torch.equal(logits.argmax(-1)[batch.action_mask], batch.targets[batch.action_mask])


def _turn(result):
    from trajgrad.rollout import Turn

    ids, logp, cut = result
    return Turn(action_ids=ids, behaviour_logp=logp, cut=cut)


def test_greedy_records_zero_logp_and_is_deterministic(tok, model):
    s = HFSampler(model, tok, temperature=0.0, max_new_tokens=8)
    a = s.rollout(Recorder(max_turns=2), tasks(2), seed=0)
    b = s.rollout(Recorder(max_turns=2), tasks(2), seed=123)
    assert [t.token_ids() for t in a] == [t.token_ids() for t in b]
    assert all(x == 0.0 for t in a for turn in t.turns for x in turn.behaviour_logp)
    assert a[0].sampling["greedy"] is True


def test_seed_reproducibility(tok, model):
    s = HFSampler(model, tok, temperature=1.0, max_new_tokens=8)
    a = s.rollout(Recorder(), tasks(2), group_size=2, seed=7)
    b = s.rollout(Recorder(), tasks(2), group_size=2, seed=7)
    c = s.rollout(Recorder(), tasks(2), group_size=2, seed=8)
    assert [t.token_ids() for t in a] == [t.token_ids() for t in b]
    assert [t.token_ids() for t in a] != [t.token_ids() for t in c]
    assert [t.turns[0].behaviour_logp for t in a] == [t.turns[0].behaviour_logp for t in b]


# ----------------------------------------------------------------------------- §4 assembly
def _expected_text(tok, env: FakeEnv, traj: Trajectory) -> str:
    last = max(i for i, m in enumerate(env.history) if m["role"] == "assistant")
    rendered = tok.apply_chat_template(env.history[: last + 1], tokenize=False)
    tail = "<|im_end|>\n" if traj.turns[-1].cut else "\n"
    assert rendered.endswith(tail)
    return rendered[: -len(tail)]


@pytest.mark.parametrize("max_new_tokens", [4, 120])
def test_multi_turn_sequence_is_the_sampled_sequence(tok, model, max_new_tokens):
    src = Recorder(max_turns=3)
    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=max_new_tokens)
    trajs = sampler.rollout(src, tasks(2), group_size=2, seed=5)
    eos = sampler.eos_id
    batch = collate(trajs, tok.pad_token_id)
    for b, (traj, env) in enumerate(zip(trajs, src.envs)):
        ids = traj.token_ids()
        # the batch row is the trajectory, token for token
        assert batch.input_ids[b, : len(ids)].tolist() == ids
        # prompt = the chat template of the reset conversation; each observation = the
        # env's messages in ChatML, tokenized alone and appended verbatim
        assert traj.prompt_ids == prompt_ids(tok, env.history[:2])
        msgs = [m for m in env.history[2:] if m["role"] != "assistant"]
        for k, turn in enumerate(traj.turns):
            assert turn.action_text == decode_action(tok, turn.action_ids, eos)
            assert turn.cut == (turn.action_ids[-1] != eos)
            assert turn.cut == (len(turn.action_ids) == max_new_tokens and turn.action_ids[-1] != eos)
            if k < len(traj.turns) - 1:
                assert turn.observation_ids == observation_ids(tok, [msgs[k]], action_closed=not turn.cut)
                first = tok.convert_ids_to_tokens(turn.observation_ids[0])
                assert first == ("<|im_end|>" if turn.cut else "\n")
            else:
                assert turn.observation_ids == []
            assert turn.reward == 0.5 * (k + 1)
            assert turn.info["cost"] == 0.25 * (k + 1)
        # decoding the whole sequence gives the conversation as the chat template renders it
        assert tok.decode(ids) == _expected_text(tok, env, traj)
        # observation and prompt targets are masked, action targets are not
        mask = traj.action_mask()
        assert sum(mask) == traj.num_action_tokens
        pos = len(traj.prompt_ids) - 1
        for turn in traj.turns:
            assert mask[pos: pos + len(turn.action_ids)] == [1] * len(turn.action_ids)
            pos += len(turn.action_ids)
            assert mask[pos: pos + len(turn.observation_ids)] == [0] * len(turn.observation_ids)
            pos += len(turn.observation_ids)
        assert traj.truncated and not traj.terminated  # hit max_turns
    if max_new_tokens == 4:
        assert any(t.cut for tr in trajs for t in tr.turns)


def test_observation_targets_receive_no_gradient(tok, model):
    """§4/§24: a policy loss on the collated batch has zero gradient w.r.t. the logits
    that predict prompt, observation and padding tokens, and changing the log-probs at
    those positions does not change the loss."""
    from trajgrad.losses import ppo_clip_loss

    trajs = HFSampler(model, tok, temperature=1.0, max_new_tokens=6).rollout(Recorder(max_turns=3), tasks(2), seed=2)
    batch = collate(trajs, tok.pad_token_id)
    m = batch.action_mask
    obs_targets = torch.zeros_like(m)
    for b, t in enumerate(trajs):
        pos = len(t.prompt_ids) - 1
        for turn in t.turns:
            pos += len(turn.action_ids)
            obs_targets[b, pos: pos + len(turn.observation_ids)] = True
            pos += len(turn.observation_ids)
    assert obs_targets.sum() > 20 and not (obs_targets & m).any()
    with torch.no_grad():
        base = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].double()
    logits = base.clone().requires_grad_(True)
    adv = torch.linspace(-1, 1, m.shape[0], dtype=torch.float64)[:, None].expand_as(logits[..., 0])
    old = batch.old_logp.double()

    def loss_of(lg, perturb=None):
        lp = token_logprobs(lg, batch.targets)  # unmasked on purpose: every position computed
        if perturb is not None:
            lp = lp + perturb
        return ppo_clip_loss(lp, old, adv, m).loss

    loss = loss_of(logits)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grad).all()
    assert (grad[obs_targets] == 0).all() and (grad[~m] == 0).all()
    assert (grad[m].abs().sum(-1) > 0).all()
    noise = torch.where(m, torch.zeros_like(old), torch.randn_like(old) * 5)
    assert loss_of(logits, noise).item() == loss.item()


# ----------------------------------------------------------------------------- §16 / §19
def test_policy_version_per_turn(tok, model):
    """A weight sync between turns changes the version recorded on later turns only."""
    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=5, policy_version=4)
    src = Recorder(max_turns=3, on_step=lambda t: sampler.set_policy_version(4 + t))
    trajs = sampler.rollout(src, tasks(2), seed=0)
    for t in trajs:
        assert [turn.policy_version for turn in t.turns] == [4, 5, 6]
    batch = collate(trajs, tok.pad_token_id)
    versions = batch.policy_version[batch.action_mask].unique().tolist()
    assert versions == [4, 5, 6]
    assert (batch.policy_version[~batch.action_mask] == -1).all()
    assert sampler.policy_version == 7


def test_compaction_starts_a_new_segment(tok, model):
    src = Recorder(max_turns=4, compact_at=2)
    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=6)
    trajs = sampler.rollout(src, tasks(2), seed=0)
    assert [(t.task_id, t.segment, len(t.turns)) for t in trajs] == [("t0", 0, 2), ("t0", 1, 2), ("t1", 0, 2), ("t1", 1, 2)]
    first, second = trajs[0], trajs[1]
    assert first.episode_id == second.episode_id and trajs[2].episode_id != first.episode_id
    assert first.turns[-1].observation_ids == [] and first.metadata["compacted"]
    assert not first.terminated and not first.truncated and second.truncated
    assert second.prompt_ids == prompt_ids(tok, [SYSTEM, {"role": "user", "content": "summary after 2"},
                                                 {"role": "user", "content": f"<result>{len(first.turns[-1].action_text)}</result>"}])
    assert second.metadata["initial_potential"] == 2.0 and first.metadata["initial_potential"] == 0.0
    assert first.metadata["num_segments"] == second.metadata["num_segments"] == 2
    assert first.metadata["episode_reward"] == pytest.approx(0.5 + 1.0 + 1.5 + 2.0)
    batch = collate(trajs, tok.pad_token_id)
    logp, ok = learner_logp(model, batch, temperature=1.0)
    assert ok.all() and ((logp - batch.old_logp)[batch.action_mask]).abs().max() < 1e-5
    assert batch.segments.tolist() == [0, 1, 0, 1] and batch.group_ids.tolist() == [0, 0, 1, 1]


def test_termination_success_and_truncation(tok, model):
    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=5)
    done = sampler.rollout(Recorder(max_turns=5, stop_after=2), tasks(1), group_size=3, seed=0)
    assert all(t.terminated and not t.truncated and t.success is True and len(t.turns) == 2 for t in done)
    assert all(t.turns[-1].observation_ids == [] and t.total_reward == 0.5 + 1.0 for t in done)
    cut = sampler.rollout(Recorder(max_turns=5, truncate_at=1), tasks(1), seed=0)
    assert cut[0].truncated and not cut[0].terminated and cut[0].success is None
    limited = sampler.rollout(Recorder(max_turns=2), tasks(1), seed=0)
    assert limited[0].truncated and limited[0].turns[-1].info["truncated_by"] == "max_turns"
    assert done[0].metadata["group_index"] == 0 and done[2].metadata["group_index"] == 2
    assert done[0].metadata["env"] == "fake"
    assert len({t.episode_id for t in done}) == 3


def test_context_limit_truncates(tok, model):
    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=8, max_context_tokens=120)
    trajs = sampler.rollout(Recorder(max_turns=50), tasks(1), seed=0)
    assert trajs[0].truncated and trajs[0].metadata["truncated_by"] == "context"
    assert len(trajs[0]) <= 120
    with pytest.raises(ValueError, match="tasks"):
        HFSampler(model, tok, max_new_tokens=8, max_context_tokens=30).rollout(Recorder(), tasks(1))


def test_task_source_and_batching_options(tok, model, capsys):
    """A TaskSource (make_env), a plain factory, max_batch_size and the progress bar."""
    a = HFSampler(model, tok, temperature=1.0, max_new_tokens=5, max_batch_size=2, progress=True)
    trajs = a.rollout(Recorder(max_turns=2), tasks(3), seed=0)
    b = HFSampler(model, tok, temperature=1.0, max_new_tokens=5).rollout(lambda: FakeEnv(max_turns=2), tasks(3), seed=0)
    assert len(trajs) == len(b) == 3
    batch = collate(trajs, tok.pad_token_id)
    logp, ok = learner_logp(model, batch, temperature=1.0)
    assert ok.all() and ((logp - batch.old_logp)[batch.action_mask]).abs().max() < 1e-5


def test_real_task_source_smoke(tok, model):
    envs = pytest.importorskip("trajgrad.envs")
    try:
        source = envs.get_task_source("calculator")
    except Exception as exc:  # pragma: no cover - depends on the envs package
        pytest.skip(f"calculator source unavailable: {exc}")
    ts = source.tasks("train", 2, 0)
    trajs = HFSampler(model, tok, temperature=1.0, max_new_tokens=8).rollout(source, ts, group_size=2, seed=0)
    assert {t.task_id for t in trajs} == {t.id for t in ts}
    assert all(t.split == "train" and t.turns for t in trajs)
    demo = demonstration_trajectory(tok, source, ts[0])
    assert demo.success and all(turn.policy_version == -1 for turn in demo.turns)
    text = tok.decode(demo.token_ids())
    for m in source.demonstration(ts[0]):
        assert m["content"] in text
    assert collate([demo] + trajs, tok.pad_token_id).action_mask[0].sum() == demo.num_action_tokens


# ----------------------------------------------------------------------------- chat
def test_observation_text_and_ids(tok):
    msgs = [{"role": "user", "content": "<result>4</result>"}]
    assert observation_text(msgs) == "\n<|im_start|>user\n<result>4</result><|im_end|>\n<|im_start|>assistant\n"
    assert observation_text(msgs, action_closed=False).startswith("<|im_end|>\n<|im_start|>user\n")
    assert observation_text([], add_generation_prompt=True) == "\n<|im_start|>assistant\n"
    ids = observation_ids(tok, msgs)
    assert tok.decode(ids) == observation_text(msgs)
    assert ids[1] == tok.convert_tokens_to_ids("<|im_start|>")
    p = prompt_ids(tok, [SYSTEM, msgs[0]])
    assert tok.decode(p) == "<|im_start|>system\nYou are a test.<|im_end|>\n<|im_start|>user\n<result>4</result><|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="messages"):
        prompt_ids(tok, [])
    with pytest.raises(ValueError, match="messages"):
        observation_ids(tok, [{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="messages"):
        observation_ids(tok, [{"role": "user"}])
    with pytest.raises(ValueError, match="messages"):
        observation_ids(tok, {"role": "user", "content": "x"})
    assert decode_action(tok, tok("ab<|im_end|>", add_special_tokens=False)["input_ids"], end_of_turn_id(tok)) == "ab"


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(policy_version=-1), "version"),
        (dict(max_batch_size=0), "max_batch_size"),
    ],
)
def test_sampler_bad_settings(tok, model, kwargs, name):
    with pytest.raises(ValueError, match=name):
        HFSampler(model, tok, **kwargs)


def test_rollout_bad_input(tok, model):
    s = HFSampler(model, tok, max_new_tokens=3)
    with pytest.raises(ValueError, match="tasks"):
        s.rollout(Recorder(), [])
    with pytest.raises(ValueError, match="tasks"):
        s.rollout(Recorder(), ["not a task"])
    with pytest.raises(ValueError, match="group_size"):
        s.rollout(Recorder(), tasks(1), group_size=0)
    with pytest.raises(ValueError, match="task_source_or_env_factory"):
        s.rollout(42, tasks(1))
    with pytest.raises(ValueError, match="version"):
        s.set_policy_version(1.5)

    class BadEnv(FakeEnv):
        def step(self, action_text):
            return "nonsense"

    with pytest.raises(ValueError, match="env"):
        s.rollout(lambda: BadEnv(), tasks(1))

    class NanEnv(FakeEnv):
        def step(self, action_text):
            return StepResult([], math.nan, True, False, {})

    with pytest.raises(ValueError, match="env"):
        s.rollout(lambda: NanEnv(), tasks(1))
    with pytest.raises(ValueError, match="sequences"):
        sample_actions(model, [[]], eos_ids=[2], pad_id=0)


def test_model_mode_is_restored(tok, model):
    model.train()
    try:
        HFSampler(model, tok, max_new_tokens=2).rollout(Recorder(max_turns=1), tasks(1), seed=0)
        assert model.training
    finally:
        model.eval()


def test_lora_wrapped_model_is_sampled_exactly(tok):
    """A PEFT LoRA model (the trainer's default) is sampled through its adapted backbone."""
    peft = pytest.importorskip("peft")
    base = build_tiny_model(tok, seed=1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # make the adapter matter (B starts at zero)
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    sampling = dict(temperature=0.9, top_p=0.95)
    trajs = HFSampler(model, tok, max_new_tokens=8, **sampling).rollout(Recorder(max_turns=2), tasks(2), seed=0)
    batch = collate(trajs, tok.pad_token_id)
    logp, ok = learner_logp(model, batch, **sampling)
    assert ok.all() and ((logp - batch.old_logp)[batch.action_mask]).abs().max() < 1e-5
    # the adapter is really in the sampled distribution: the bare base model disagrees
    with model.disable_adapter():
        logp_base, _ = learner_logp(model, batch, **sampling)
    assert (logp_base - batch.old_logp)[batch.action_mask].abs().max() > 1e-3


def test_before_turn_hook_updates_version_between_turns(tok, model):
    """before_turn(k) runs before the k-th batched generation; a version set there is
    recorded on the turns sampled after it (§16), the earlier turns keep theirs."""
    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=4)
    calls = []

    def hook(k):
        calls.append(k)
        sampler.set_policy_version(10 + k)

    trajs = sampler.rollout(Recorder(max_turns=3), tasks(2), seed=0, before_turn=hook)
    assert calls == [0, 1, 2]
    assert [[turn.policy_version for turn in t.turns] for t in trajs] == [[10, 11, 12], [10, 11, 12]]
    with pytest.raises(ValueError, match="before_turn"):
        sampler.rollout(Recorder(), tasks(1), before_turn=3)


# ----------------------------------------------------------------------------- KV reuse
def _count_embedded_tokens(model):
    """Count the tokens the model embeds (every position it computes)."""
    seen = [0]
    emb = model.get_input_embeddings()
    handle = emb.register_forward_hook(lambda mod, inp, out: seen.__setitem__(0, seen[0] + inp[0].numel()))
    return seen, handle


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.9)], ids=["greedy", "T1-p0.9"])
def test_kv_reuse_equals_full_recompute(tok, model, sampling):
    """Reusing each episode's keys/values across turns and computing the shared prompt
    prefix once gives the same actions and the same behaviour log-probs as recomputing
    the whole context every turn, while embedding far fewer tokens."""
    ts = [Task(id=f"k{i}", split="train", prompt="question " * (i + 1), answer=0) for i in range(3)]
    out, counts = {}, {}
    for reuse in (True, False):
        seen, handle = _count_embedded_tokens(model)
        try:
            s = HFSampler(model, tok, max_new_tokens=12, reuse_kv=reuse, **sampling)
            out[reuse] = s.rollout(Recorder(max_turns=3), ts, group_size=2, seed=5)
        finally:
            handle.remove()
        counts[reuse] = seen[0]
    a, b = out[True], out[False]
    assert [[u.action_ids for u in t.turns] for t in a] == [[u.action_ids for u in t.turns] for t in b]
    assert sum(len(t.turns) for t in a) >= 12
    for ta, tb in zip(a, b):
        for ua, ub in zip(ta.turns, tb.turns):
            assert max((abs(x - y) for x, y in zip(ua.behaviour_logp, ub.behaviour_logp)), default=0.0) < 1e-5
    assert counts[True] < 0.6 * counts[False], counts


def test_kv_reuse_is_dropped_when_the_policy_version_changes(tok, model):
    """A version change between turns (new weights) invalidates the cached keys/values:
    the next turn recomputes the whole context."""
    ts = [Task(id="v", split="train", prompt="hello", answer=0)]

    def tokens_embedded(hook):
        seen, handle = _count_embedded_tokens(model)
        try:
            s = HFSampler(model, tok, temperature=0.0, max_new_tokens=6)
            s.rollout(Recorder(max_turns=3), ts, seed=0, before_turn=lambda turn: hook(s, turn))
        finally:
            handle.remove()
        return seen[0]

    kept = tokens_embedded(lambda s, turn: None)
    bumped = tokens_embedded(lambda s, turn: s.set_policy_version(turn))
    cleared = tokens_embedded(lambda s, turn: s.clear_cache())
    assert bumped > kept and cleared == bumped


def test_sample_actions_past_kv_validation(tok, model):
    eos = end_of_turn_id(tok)
    seqs = [prompt_ids(tok, [{"role": "user", "content": "abc"}])]
    (res, kv) = sample_actions(model, seqs, eos_ids=[eos], pad_id=0, temperature=0.0, max_new_tokens=4, return_kv=True)
    assert kv[0] is not None and kv[0].length == len(seqs[0]) + len(res[0][0]) - 1
    longer = [seqs[0] + res[0][0] + [5, 6]]
    again = sample_actions(model, longer, eos_ids=[eos], pad_id=0, temperature=0.0, max_new_tokens=4, past_kv=kv)
    fresh = sample_actions(model, longer, eos_ids=[eos], pad_id=0, temperature=0.0, max_new_tokens=4)
    assert again[0][0] == fresh[0][0]
    with pytest.raises(ValueError, match="past_kv"):
        sample_actions(model, seqs + seqs, eos_ids=[eos], pad_id=0, max_new_tokens=4, past_kv=kv)
    with pytest.raises(ValueError, match="past_kv"):
        sample_actions(model, [seqs[0][:kv[0].length]], eos_ids=[eos], pad_id=0, max_new_tokens=4, past_kv=kv)
    with pytest.raises(ValueError, match="past_kv"):
        sample_actions(model, seqs, eos_ids=[eos], pad_id=0, max_new_tokens=4, past_kv=["nope"])


def test_last_allowed_turn_keeps_no_keys_values_and_prompts_are_encoded_once(tok, model, monkeypatch):
    """An episode on its last allowed turn ends after it, so its keys/values are not read
    back; a group's members share one prompt encoding. Neither changes what is sampled."""
    import trajgrad.rollout.episodes as episodes_mod
    import trajgrad.rollout.generation as generation_mod

    extracted, encoded = [], []
    real_extract, real_prompt = generation_mod.extract_rows, episodes_mod.prompt_ids
    monkeypatch.setattr(generation_mod, "extract_rows", lambda *a: extracted.append(len(a[1])) or real_extract(*a))
    monkeypatch.setattr(episodes_mod, "prompt_ids", lambda *a: encoded.append(1) or real_prompt(*a))
    out = {}
    for turns in (1, 3):
        extracted.clear(), encoded.clear()
        s = HFSampler(model, tok, max_new_tokens=6, temperature=1.0)
        trajs = s.rollout(Recorder(max_turns=turns), tasks(2), group_size=3, seed=0)
        out[turns] = (list(extracted), len(encoded), trajs)
    # one turn: only the shared prompt prefix is read back (one row per distinct prompt)
    assert out[1][0] == [2] and out[1][1] == 2
    # three turns: rows are read back for the turns that follow
    assert sum(out[3][0]) > 2 and out[3][1] == 2
    # the first turn's tokens do not depend on whether keys/values were kept
    first = lambda trajs: [t.turns[0].action_ids for t in trajs]  # noqa: E731
    assert first(out[1][2]) == first(out[3][2])


# ----------------------------------------------------------------------------- composition
class ScriptedBackend:
    """An action backend that answers from a script: the episode loop needs nothing else."""

    reuse_kv = False
    device = torch.device("cpu")

    def __init__(self, tok, versions):
        from trajgrad.rollout.generation import SamplingSettings

        self.settings = SamplingSettings.create(1.0, None, None, 4)
        self.eos_id = end_of_turn_id(tok)
        self.versions = iter(versions)
        self.calls = []
        self.in_eval = False

    def context_limit(self):
        return None

    def describe(self):
        return {"model": "scripted"}

    def eval_mode(self):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.in_eval = True
            yield
            self.in_eval = False

        return scope()

    def generate(self, seqs, generator, *, seeded=True, past=None, keep_kv=False):
        from trajgrad.rollout.generation import Action

        assert self.in_eval and past is None
        self.calls.append([list(s) for s in seqs])
        out = []
        for s in seqs:
            ids = [40 + len(s) % 7, 41, self.eos_id]
            out.append(Action(ids, [-0.5, -0.25, -0.125], False, next(self.versions)))
        return out, [None] * len(seqs)


def test_episode_runner_takes_any_action_backend(tok):
    """The episode loop runs over a backend by composition: sequences in, actions out, the
    tokens sent being exactly prompt + earlier actions + observations; a version the backend
    reports is recorded on its turn, otherwise the runner's own."""
    from trajgrad.rollout.episodes import EpisodeRunner

    backend = ScriptedBackend(tok, [None, 7, None, 8, None, 9])
    runner = EpisodeRunner(backend, tok, policy_version=2)
    trajs = runner.rollout(Recorder(max_turns=3), tasks(2), group_size=1, seed=0)
    assert len(backend.calls) == 3 and [len(c) for c in backend.calls] == [2, 2, 2]
    versions = [[t.policy_version for t in tr.turns] for tr in trajs]
    assert versions == [[2, 2, 2], [7, 8, 9]]
    for tr in trajs:
        assert tr.sampling["model"] == "scripted" and tr.token_ids()[: len(tr.prompt_ids)] == tr.prompt_ids
        assert all(t.behaviour_logp == [-0.5, -0.25, -0.125] for t in tr.turns)
    # what the backend was sent at turn k is the trajectory's tokens up to that turn
    for k in range(3):
        for row, tr in enumerate(trajs):
            sent = backend.calls[k][row]
            assert tr.token_ids()[: len(sent)] == sent
    assert not backend.in_eval


def test_hf_sampler_is_the_episode_loop_over_the_hf_backend(tok, model):
    from trajgrad.rollout.episodes import EpisodeRunner
    from trajgrad.rollout.generation import HFBackend

    s = HFSampler(model, tok, max_new_tokens=5, temperature=0.9, top_k=20, reuse_kv=False)
    assert isinstance(s, EpisodeRunner) and isinstance(s.backend, HFBackend) and s.model is model
    direct = EpisodeRunner(HFBackend(model, tok, max_new_tokens=5, temperature=0.9, top_k=20, reuse_kv=False), tok)
    a = s.rollout(Recorder(max_turns=2), tasks(2), group_size=2, seed=4)
    b = direct.rollout(Recorder(max_turns=2), tasks(2), group_size=2, seed=4)
    assert [t.token_ids() for t in a] == [t.token_ids() for t in b]
    assert [[u.behaviour_logp for u in t.turns] for t in a] == [[u.behaviour_logp for u in t.turns] for t in b]
    assert (s.temperature, s.top_k, s.top_p, s.max_new_tokens) == (0.9, 20, None, 5)
    assert s.max_context_tokens == model.config.max_position_embeddings


def test_groups_with_prompts_of_different_lengths_each_share_their_whole_prompt(tok):
    """Three groups whose prompts share 12 tokens and then differ in length (20, 27, 33 tokens):
    each group's whole prompt (but its last token) is run once and handed to its rows, and
    what is sampled is what sampling without any kept keys/values gives."""
    from trajgrad.model.positions import prefix_groups
    from trajgrad.rollout.generation import HFBackend

    model = build_tiny_model(tok, hidden_size=32, layers=2, heads=4, kv_heads=2, seed=5, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    common = torch.randint(5, 60, (12,), generator=g).tolist()
    prompts = [common + torch.randint(5, 60, (n - 12,), generator=g).tolist() for n in (20, 27, 33)]
    seqs = [p for p in prompts for _ in range(4)]
    ids = torch.zeros(len(seqs), 33, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)], mask[r, :len(s)] = torch.as_tensor(s), 1
    groups = prefix_groups(ids, mask, min_prefix=8)
    assert groups.lengths.tolist() == [19, 26, 32] and groups.index.tolist() == [u for u in range(3) for _ in range(4)]

    backend = HFBackend(model, tok, max_new_tokens=6, temperature=1.0)
    shared = backend._shared_prefix(seqs, [None] * len(seqs))
    assert [p.length for p in shared] == [n - 1 for n in (20, 27, 33) for _ in range(4)]
    assert len({id(p) for p in shared}) == 3  # one object per group: the decode step keeps each once
    with backend.eval_mode():
        kept, _ = backend.generate(seqs, torch.Generator().manual_seed(7), past=[None] * len(seqs))
        plain, _ = backend.generate(seqs, torch.Generator().manual_seed(7))
    assert [a.ids for a in kept] == [a.ids for a in plain]
    for a, b in zip(kept, plain):
        assert max(abs(x - y) for x, y in zip(a.logp, b.logp)) < 1e-6


@pytest.mark.parametrize("fast_decode", [True, False])
def test_an_end_token_drawn_at_the_last_step_ends_the_action_uncut(tok, fast_decode):
    """``cut`` is True only where ``max_new_tokens`` stopped an action before an end token:
    a row whose last allowed token is an end token is not cut, its neighbours are, and rows
    that end earlier keep exactly their tokens up to their end token (greedy, so the end
    tokens are chosen from a first run)."""
    model = build_tiny_model(tok, hidden_size=64, layers=2, heads=4, seed=3, initializer_range=0.2).eval()
    texts = ["ab", "hello there", "x" * 25, "9+4", "what is 12*7?", "zq", "a b c d", "42", "tool", "The end."]
    seqs = [prompt_ids(tok, [{"role": "user", "content": c}]) for c in texts]
    kw = dict(pad_id=0, temperature=0.0, fast_decode=fast_decode)
    free = sample_actions(model, seqs, eos_ids=[], max_new_tokens=6, **kw)
    assert all(len(ids) == 6 and cut for ids, _, cut in free)
    # a row whose sixth token is new to it goes first; that token is made the end token
    first = next(i for i, (ids, _, _) in enumerate(free) if ids[5] not in ids[:5])
    seqs.insert(0, seqs.pop(first))
    free.insert(0, free.pop(first))
    ids0 = free[0][0]
    end = ids0[5]
    got = sample_actions(model, seqs, eos_ids=[end], max_new_tokens=6, **kw)
    assert got[0] == (ids0, [0.0] * 6, False)
    for (ids, _, _), (g_ids, g_lp, g_cut) in zip(free[1:], got[1:]):
        k = ids.index(end) + 1 if end in ids else 6
        assert g_ids == ids[:k] and g_lp == [0.0] * k and g_cut == (end not in ids)
