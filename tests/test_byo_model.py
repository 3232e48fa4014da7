"""Bring your own model: any Hugging Face causal LM through ``model.path``, rendered with its
own chat template token in / token out, with the template prefix check (issue 12, items 1-2).

Three tiny random architectures (Qwen2, Llama, Gemma) with family-style templates
(tests/_tiny_models.py); nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _tiny_models import (  # noqa: E402
    FAMILIES, LLAMA3_TRIM_TEMPLATE, QWEN2_TEMPLATE, QWEN3_DROP_THINK_TEMPLATE, family_model, family_tokenizer,
    save_family_checkpoint,
)

from trajgrad.envs.base import StepResult, Task  # noqa: E402
from trajgrad.model.build import build_model, lora_target_modules  # noqa: E402
from trajgrad.model.decode import fast_backbone  # noqa: E402
from trajgrad.model.learner import learner_logprobs  # noqa: E402
from trajgrad.model.pretrained import resolve_model_path  # noqa: E402
from trajgrad.rollout import HFSampler, collate  # noqa: E402
from trajgrad.rollout.chat import (  # noqa: E402
    ChatSession, TemplateMismatch, chat_text, encode, end_of_turn_id, tool_schemas_of,
)
from trajgrad.rollout.episodes import EpisodeRunner  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


class ToolEnv:
    """Answers every action with a ``tool`` message for two turns, then ends (success)."""

    name = "tool-env"
    max_turns = 3
    tool_schemas = [ADD_TOOL]

    def __init__(self, tool_role: str = "tool"):
        self.history, self.t, self.role = [], 0, tool_role

    def reset(self, task):
        self.t = 0
        self.history = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": task.prompt}]
        return list(self.history)

    def step(self, action_text):
        self.t += 1
        self.history.append({"role": "assistant", "content": action_text})
        if self.t >= 3:
            return StepResult([], 1.0, True, False, {"success": True})
        msg = {"role": self.role, "content": f"result {self.t}: {len(action_text)}"}
        self.history.append(msg)
        return StepResult([msg], 0.1, False, False, {})


def _tasks(n):
    return [Task(id=f"t{i}", split="train", prompt=f"add {i} and {i + 2}", answer=2 * i + 2) for i in range(n)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    tok = family_tokenizer(request.param)
    return request.param, tok, family_model(request.param, tok, seed=1)


def test_tool_episodes_train_the_sampled_tokens_with_exact_logprobs(family):
    """Multi-turn tool episodes: the prompt is the template's rendering with the tool schemas;
    the trained tokens are the sampled ones; the whole sequence is what the template renders
    for the conversation; recomputed log-probs equal the recorded ones (ratio 1 within 1e-5)."""
    name, tok, model = family
    # the lean decode step only where it computes the same function (Llama); the others' own forward
    assert (fast_backbone(model) is not None) == (name == "llama")
    envs = []

    def make_env():
        envs.append(ToolEnv())
        return envs[-1]

    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=6)
    trajs = sampler.rollout(make_env, _tasks(3), group_size=2, seed=0)
    assert sampler.eos_id == end_of_turn_id(tok) == tok.convert_tokens_to_ids(FAMILIES[name][1])
    assert sampler.template_mismatches == 0 and len(trajs) == 6
    assert all(len(t.turns) == 3 for t in trajs)  # three turns, two tool observations each
    assert any(turn.cut for t in trajs for turn in t.turns)
    for t, env in zip(trajs, envs):
        assert t.prompt_ids == encode(tok, chat_text(tok, env.history[:2], tools=[ADD_TOOL]))
        assert '"name": "add"' in tok.decode(t.prompt_ids)
        # token in / token out: the sequence is the prompt, then each action exactly as sampled
        # and the template's suffix; decoded, it is the template's rendering of the conversation
        ids = list(t.prompt_ids)
        for turn in t.turns:
            ids += turn.action_ids + turn.observation_ids
        assert ids == t.token_ids()
        rendered = chat_text(tok, env.history, tools=[ADD_TOOL], add_generation_prompt=False)
        assert rendered.startswith(tok.decode(ids, skip_special_tokens=False))
        for turn, msg in zip(t.turns, [m for m in env.history if m["role"] == "tool"]):
            assert msg["content"] in tok.decode(turn.observation_ids)
    batch = collate(trajs, tok.pad_token_id)
    sampled = torch.tensor([i for t in trajs for turn in t.turns for i in turn.action_ids])
    assert torch.equal(batch.targets[batch.action_mask], sampled)
    with torch.no_grad():
        out = learner_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=1.0)
    ratio = torch.exp(out.logp - batch.old_logp)[batch.action_mask]
    assert ratio.numel() == sampled.numel() > 30
    assert (ratio - 1).abs().max().item() < 1e-5


class Scripted:
    """An action backend that writes fixed text (tokenized), for template checks."""

    reuse_kv = False
    device = torch.device("cpu")

    def __init__(self, tok, texts):
        from trajgrad.rollout.generation import SamplingSettings

        self.settings = SamplingSettings.create(1.0, None, None, 64)
        self.tok, self.texts, self.eos_id = tok, list(texts), end_of_turn_id(tok)
        self.calls = 0

    def generate(self, seqs, generator, *, seeded, past=None, keep_kv=True):
        from trajgrad.rollout.generation import Action

        text = self.texts[min(self.calls, len(self.texts) - 1)]
        self.calls += 1
        ids = encode(self.tok, text) + [self.eos_id]
        return [Action(ids, [-0.5] * len(ids), False) for _ in seqs], [None] * len(seqs)

    def context_limit(self):
        return None

    def describe(self):
        return {"model": "scripted"}

    def eval_mode(self):
        import contextlib

        return contextlib.nullcontext()


class ChatEnv(ToolEnv):
    """Like ToolEnv, with ``user`` messages (a new query: Qwen3 drops the reasoning before it)."""

    tool_schemas = None

    def __init__(self):
        super().__init__(tool_role="user")


@pytest.mark.parametrize("template, text", [
    (QWEN3_DROP_THINK_TEMPLATE, "<think>plan</think>answer"),  # drops earlier reasoning
    (LLAMA3_TRIM_TEMPLATE, "answer "),  # trims whitespace
])
def test_a_template_that_re_renders_history_differently_is_detected(template, text):
    family = "llama" if template is LLAMA3_TRIM_TEMPLATE else "qwen2"
    tok = family_tokenizer(family, template=template)
    # error mode: one clear error naming the setting
    runner = EpisodeRunner(Scripted(tok, [text]), tok)
    with pytest.raises(TemplateMismatch, match=r"rollout\.template_mismatch.*truncate"):
        runner.rollout(ChatEnv, _tasks(2))
    assert runner.template_mismatches == 1
    # truncate mode: the episode ends as truncated at the action; nothing after it is trained
    runner = EpisodeRunner(Scripted(tok, [text]), tok, template_mismatch="truncate")
    trajs = runner.rollout(ChatEnv, _tasks(2), group_size=2)
    assert runner.template_mismatches == 4 and len(trajs) == 4
    for t in trajs:
        assert t.truncated and not t.terminated and len(t.turns) == 1 and t.turns[0].observation_ids == []
        assert t.metadata["template_mismatch"] and t.metadata["truncated_by"] == "template_mismatch"
    # the check is not a false alarm: a template that keeps the history as sampled passes
    for ok_template, ok_text in ((FAMILIES[family][3], text), (template, "answer")):
        tok_ok = family_tokenizer(family, template=ok_template)
        runner = EpisodeRunner(Scripted(tok_ok, [ok_text]), tok_ok)
        trajs = runner.rollout(ChatEnv, _tasks(1))
        assert runner.template_mismatches == 0 and len(trajs[0].turns) == 3 and trajs[0].terminated
    with pytest.raises(ValueError, match="template_mismatch"):
        EpisodeRunner(Scripted(tok, [text]), tok, template_mismatch="ignore")


def test_chat_session_observation_is_the_template_suffix():
    tok = family_tokenizer("gemma")
    eot = end_of_turn_id(tok)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    s = ChatSession(tok, msgs)
    start = list(s.prompt_ids)
    obs = s.observe(encode(tok, "A") + [eot], "A", [{"role": "user", "content": "R"}])
    assert tok.decode(obs) == "\n<start_of_turn>user\nR<end_of_turn>\n<start_of_turn>model\n"
    full = chat_text(tok, msgs + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "R"}])
    assert tok.decode(start + encode(tok, "A") + [eot] + obs) == full
    # a cut action: the observation closes the turn with the end-of-turn token first
    obs = s.observe(encode(tok, "B"), "B", [{"role": "user", "content": "T"}])
    assert obs[0] == eot
    # a mismatch leaves the session unchanged
    before = (list(s.messages), s.text)
    with pytest.raises(TemplateMismatch, match="held"):
        s.observe(encode(tok, "C") + [eot], "different text", [])
    assert (s.messages, s.text) == before


def test_tool_schemas_come_from_the_environment_or_the_task_source():
    class Src:
        def tool_schemas(self):
            return [ADD_TOOL]

    class Env:
        tool_schemas = None

    assert tool_schemas_of(Env(), Src()) == [ADD_TOOL]
    assert tool_schemas_of(object(), object()) is None
    with pytest.raises(ValueError, match="tools"):
        tool_schemas_of(type("E", (), {"tool_schemas": {"not": "a list"}})())


# ----------------------------------------------------------------------------- model.path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_family_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2-ckpt"), seed=3)


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_lora_targets_are_detected_per_architecture(fam):
    tok = family_tokenizer(fam)
    model = family_model(fam, tok)
    assert lora_target_modules(model) == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_lora_targets_fall_back_to_peft_defaults():
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=40, n_embd=16, n_layer=1, n_head=2))
    assert lora_target_modules(gpt2) == ["c_attn"]


def test_model_path_loads_with_lora_or_full_fine_tuning(qwen_dir):
    from trajgrad.train.config import LoraConfig

    model, tok = build_model(path=qwen_dir, dtype="float32", lora=LoraConfig(r=2), train=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("o_proj" in n for n in trainable) and tok.chat_template == QWEN2_TEMPLATE
    full, _ = build_model(path=qwen_dir, dtype="float32", lora=None, train=True)
    assert all(p.requires_grad for p in full.parameters()) and full.training
    assert type(full).__name__ == "Qwen2ForCausalLM" and fast_backbone(full.eval()) is None
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules.*nope"):
        build_model(path=qwen_dir, lora=LoraConfig(target_modules=["nope"]))


def _path_config(path, **extra):
    from trajgrad.train.config import load_config

    over = {"model.path": path, "model.dtype": "float32", "train.steps": 2, "train.prompts_per_step": 2,
            "train.group_size": 2, "train.micro_batch_size": 4, "sampling.max_new_tokens": 6, "sft.steps": 1,
            "sft.batch_size": 2, "eval.before": False, "eval.after": False, "checkpoint.every": 0,
            "task.n_train": 8, "task.n_heldout": 2, **extra}
    return load_config(preset="tiny", overrides=over)


@pytest.mark.parametrize("lora", [None, {"r": 2}])
def test_a_saved_checkpoint_trains_two_steps_through_model_path(qwen_dir, tmp_path, lora):
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.trainer import Trainer

    cfg = _path_config(qwen_dir, **{"model.lora": lora})
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    assert type(tr.model.get_base_model() if lora else tr.model).__name__ == "Qwen2ForCausalLM"
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.run()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    changed = [n for n, p in tr.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed


def test_hub_id_resolves_from_the_local_cache_only(tmp_path, monkeypatch, qwen_dir):
    import shutil

    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snap = cache / "models--someone--tiny-qwen" / "snapshots" / ("a" * 40)
    shutil.copytree(qwen_dir, snap)
    (cache / "models--someone--tiny-qwen" / "refs").mkdir()
    (cache / "models--someone--tiny-qwen" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert resolve_model_path("someone/tiny-qwen") == snap
    model, tok = build_model(path="someone/tiny-qwen", dtype="float32")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=r"^model\.path: 'someone/absent'.*local Hugging Face cache.*"
                       + str(cache).replace("/", ".")) as err:
        resolve_model_path("someone/absent")
    assert "nothing is downloaded" in str(err.value)


def test_bad_paths_give_one_clear_error_naming_the_key(tmp_path, qwen_dir):
    from trajgrad.train.config import load_config

    with pytest.raises(ValueError, match=r"^model\.path: no such directory .*nowhere"):
        _path_config(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"^model\.path: .*holds no config\.json"):
        _path_config(str(empty))
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match=r"^model\.path: .*holds no weights"):
        _path_config(str(empty))
    with pytest.raises(ValueError, match=r"^model\.path: .*Hugging Face cache"):
        _path_config("nobody/no-such-model-xyz")
    capped = tmp_path / "capped"
    capped.mkdir()
    for f in os.listdir(qwen_dir):
        (capped / f).write_bytes((open(os.path.join(qwen_dir, f), "rb")).read())
    cfg = json.loads((capped / "config.json").read_text())
    (capped / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 30.0}))
    with pytest.raises(ValueError, match=r"^model\.path: .*final_logit_softcapping"):
        _path_config(str(capped))
    with pytest.raises(ValueError, match=r"^teacher\.path: no such directory"):
        _path_config(qwen_dir, **{"recipe.name": "opd", "teacher.path": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match=r"model\.tiny\.hidden_size: has no effect"):
        _path_config(qwen_dir, **{"model.tiny.hidden_size": 64})
    with pytest.raises(ValueError, match=r"rollout\.template_mismatch"):
        _path_config(qwen_dir, **{"rollout.template_mismatch": "ignore"})
    assert load_config(preset="tiny", overrides={"rollout.template_mismatch": "truncate"}).rollout.template_mismatch \
        == "truncate"


def test_teacher_from_a_path_shares_the_policy_tokenizer(qwen_dir, tmp_path):
    from trajgrad.train.setup import build_teacher

    cfg = _path_config(qwen_dir, **{"recipe.name": "opd", "teacher.path": qwen_dir, "model.lora": None})
    _, tok = build_model(path=qwen_dir)
    teacher = build_teacher(cfg, tok, sft=None, console=lambda *_: None)
    assert type(teacher).__name__ == "Qwen2ForCausalLM" and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    other = save_family_checkpoint("llama", tmp_path / "llama", seed=0)
    cfg = _path_config(qwen_dir, **{"recipe.name": "opd", "teacher.path": other})
    with pytest.raises(ValueError, match=r"^teacher\.path: .*another vocabulary"):
        build_teacher(cfg, tok, sft=None, console=lambda *_: None)
    # a tiny teacher needs the tiny tokenizer: refused at load time, naming the key
    with pytest.raises(ValueError, match=r"teacher\.name: 'sft' builds a tiny teacher.*teacher\.path"):
        _path_config(qwen_dir, **{"recipe.name": "opd"})


def test_lean_decode_of_a_loaded_llama_variant_equals_its_own_forward():
    """Llama variants (biases in attention and MLP, llama3 rope scaling, an explicit head
    size, grouped-query attention) decode with the lean step; it equals the model's forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trajgrad.rollout.generation import sample_actions

    tok = family_tokenizer("llama")
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tok), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, mlp_bias=True,
        initializer_range=0.2, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert fast_backbone(model) is not None
    seqs = [encode(tok, "x" * n) for n in (3, 17, 40)]
    eot = end_of_turn_id(tok)
    runs = [sample_actions(model, seqs, eos_ids=[eot], pad_id=tok.pad_token_id, temperature=1.0, max_new_tokens=24,
                           generator=torch.Generator().manual_seed(5), fast_decode=fast) for fast in (True, False)]
    for (ids_a, lp_a, _), (ids_b, lp_b, _) in zip(*runs):
        assert ids_a == ids_b
        assert max(abs(a - b) for a, b in zip(lp_a, lp_b)) < 1e-5


def test_a_template_that_refuses_a_conversation_gives_a_value_error():
    strict = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
              "{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + '<end_of_turn>\\n' }}"
              "{% endfor %}")
    tok = family_tokenizer("gemma", template=strict)
    with pytest.raises(ValueError, match=r"^messages: the chat template refused .*'system'.*System role not supported"):
        chat_text(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])
    assert chat_text(tok, [{"role": "user", "content": "Q"}]) == "<start_of_turn>user\nQ<end_of_turn>\n"
