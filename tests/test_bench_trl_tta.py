"""bench/bench_trl_tta.py: the tag protocol for TRL's tool loop, the marks, both sides on a tiny model, the report.

The TRL side runs where trl is installed (the peers environment, `make peers`); the rest runs anywhere.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

_PATH = Path(__file__).resolve().parents[1] / "bench" / "bench_trl_tta.py"
_spec = importlib.util.spec_from_file_location("bench_trl_tta", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
loop = sys.modules["_trl_tool_loop"]

HAVE_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAVE_TRL, reason="trl is not installed here (the peers environment, `make peers`)")


def _tok():
    from trajgrad.model.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def _source():
    from trajgrad.envs import get_task_source

    return get_task_source("calculator", max_turns=2, max_turns_terminates=True, system_prompt="")


def test_tool_template_renders_the_envs_conversation():
    """A TRL tool exchange renders to the text of trajgrad's calculator conversation, token for token."""
    from trajgrad.rollout.chat import chat_text

    tok = _tok()
    plain = [{"role": "user", "content": "What is 3 * 4?"}, {"role": "assistant", "content": "<calc>3 * 4</calc>"},
             {"role": "user", "content": "<result>12</result>"}]
    trl_style = [plain[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"expression": "3 * 4"}}}]},
        {"role": "tool", "name": "calc", "content": "12"}]
    want = chat_text(tok, plain)
    tok.chat_template = loop.tag_tool_template(tok.chat_template)
    assert chat_text(tok, trl_style) == want
    other = [plain[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": "x"}}}]}]
    assert '<f>{"a": 1, "b": "x"}</f>' in chat_text(tok, other, add_generation_prompt=False)
    with pytest.raises(ValueError, match="chat_template"):
        loop.tag_tool_template(None)


@needs_trl
def test_trl_accepts_the_tool_template():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    tok = _tok()
    assert not supports_tool_calling(tok)  # the plain ChatML template: TRL refuses it
    tok.chat_template = loop.tag_tool_template(tok.chat_template)
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)


_PIECE = st.one_of(
    st.builds(lambda a, b: f"<calc>{a} + {b}</calc>", st.integers(0, 99), st.integers(0, 99)),
    st.builds(lambda a: f"<answer>{a}</answer>", st.integers(0, 999)),
    st.builds(lambda a: f"<calc>{a} *", st.integers(0, 99)),  # cut before its closing tag
    st.sampled_from(["<result>7</result>", " ", "ok ", "\n", "<answer>"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(_PIECE, min_size=1, max_size=4))
def test_the_parser_calls_the_tool_exactly_when_the_env_would(pieces):
    """The response template's tool call is the env's first action: a complete <calc> tag not
    preceded by a complete <answer> tag (CalculatorEnv.step decides for trajgrad)."""
    from transformers.utils.chat_parsing import parse_response

    text = "".join(pieces)
    parsed = parse_response(text + "<|im_end|>", loop.tag_response_template(),
                            prefix="<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    env = _source().make_env()
    env.reset(_source().tasks("train", 1, 0)[0])
    res = env.step(text)
    is_call = res.info.get("tool") == "calculator"
    calls = parsed.get("tool_calls") or []
    assert bool(calls) == is_call, (text, parsed)
    if is_call:
        expr = text[text.index("<calc>") + 6:text.index("</calc>")]
        assert len(calls) == 1 and calls[0]["function"] == {"name": "calc", "arguments": {"expression": expr}}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _call(expr):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"expression": expr}}}]}


def test_the_reward_is_the_envs_episode_return():
    src = _source()
    task = src.tasks("train", 1, 0)[0]
    row = json.dumps({"id": task.id, "split": task.split, "prompt": task.prompt, "answer": task.answer,
                      "metadata": task.metadata})
    expr, ans = task.metadata["expression"], task.answer
    tools = loop.CalculatorTools(src)
    before = dict(loop.CalculatorTools.counts)

    def episode(*turns):
        tools.reset(task=row)
        return tools

    t = episode()
    assert t.calc(expr) == str(ans)
    assert loop.env_reward([[_call(expr), {"role": "tool", "content": str(ans)}, _assistant(f"<answer>{ans}</answer>")]],
                           [t]) == [pytest.approx(1.1)]  # format bonus + the right answer
    t = episode()
    assert loop.env_reward([[_assistant(f"<answer>{ans + 1}</answer>")]], [t]) == [0.0]
    t = episode()
    assert t.calc("1 +") .startswith("error:")  # the calculator's own error message
    assert loop.env_reward([[_call("1 +"), {"role": "tool", "content": "x"}, _call(expr)]], [t]) == [pytest.approx(0.1)]
    t = episode()  # a first turn without an action: TRL ends, the env would have given a second turn
    assert loop.env_reward([[_assistant("<result>5</result>")]], [t]) == [0.0]
    after = loop.CalculatorTools.counts
    assert after["ended_before_env"] - before["ended_before_env"] == 1
    assert after["episodes"] - before["episodes"] == 4
    with pytest.raises(ValueError, match="task"):
        tools.reset()


class _Lora(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lora_A = torch.nn.Linear(2, 2, bias=False)


def test_a_mark_keeps_the_weights_of_the_last_step_before_it(tmp_path, monkeypatch):
    clock = {"t": 1000.0}
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock["t"])
    model = _Lora()
    keeper = bench.MarkKeeper([1, 2], tmp_path, "trl", 3, model)
    keeper.start()
    seen = {}
    for step, t in enumerate([50.0, 100.0, 130.0], start=1):
        with torch.no_grad():
            model.lora_A.weight.fill_(float(step))
        clock["t"] = 1000.0 + t
        seen[step] = keeper.step_done(model, step)
    assert seen == {1: False, 2: False, 3: True} and keeper.ends == [50.0, 100.0, 130.0]
    assert {m: (s["steps"], s["train_s"]) for m, s in keeper.saved.items()} == {1.0: (1, 50.0), 2.0: (2, 100.0)}
    for mark, step in ((1, 1), (2, 2)):  # 1 min: step 1 ended at 50 s, step 2 at 100 s; 2 min: step 3 at 130 s
        ck = torch.load(tmp_path / f"trl-s3-m{mark}.pt")
        assert torch.equal(ck["state"]["lora_A.weight"], torch.full((2, 2), float(step)))
    with pytest.raises(ValueError, match="LoRA"):
        bench.MarkKeeper([1], tmp_path, "trl", 0, torch.nn.Linear(2, 2))


def test_marks_and_workload_errors():
    assert bench.parse_marks("5,2") == [2.0, 5.0]
    for bad in ("", "0", "a,2", "-1"):
        with pytest.raises(ValueError, match="--marks"):
            bench.parse_marks(bad)
    with pytest.raises(ValueError, match="--workload"):
        bench.cell_config("nope", 0)


def test_trajgrad_side_and_trajgrads_evaluator_on_a_tiny_model(tmp_path):
    cfg = bench.cell_config("tiny", 0)
    out = bench.run_trajgrad(cfg, [0.001], tmp_path)
    (ck,) = out["checkpoints"]  # the weights after the last step that ended by 0.06 s; the run ends one step later
    assert out["steps_run"] >= 1 and ck["mark_min"] == 0.001 and ck["steps"] == out["steps_run"] - 1
    assert len(out["step_ends_s"]) == out["steps_run"]
    evals = bench.run_eval(bench.cell_config("tiny", 0), [ck["path"]], base=True)
    assert [e["path"] for e in evals] == [None, ck["path"]]
    assert all(e["n"] == 4 and 0 <= e["successes"] <= 4 for e in evals)
    bad = tmp_path / "bad.pt"
    torch.save({"state": {"lora_x": torch.zeros(1)}}, bad)
    with pytest.raises(ValueError, match="do not match"):
        bench.run_eval(bench.cell_config("tiny", 0), [str(bad)], base=False)


@needs_trl
def test_trl_side_on_a_tiny_model_gives_weights_trajgrads_evaluator_loads(tmp_path):
    cfg = bench.cell_config("tiny", 0)
    out = bench.run_trl(cfg, [0.001], tmp_path)
    (ck,) = out["checkpoints"]
    assert out["steps_run"] >= 1 and ck["steps"] == out["steps_run"] - 1 and out["protocol"]["episodes"] >= 4
    args = bench.trl_args(cfg, str(tmp_path))
    assert (args.loss_type, args.scale_rewards, args.beta, args.num_iterations) == ("grpo", "group", 0.0, 1)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 4 and args.num_generations == 2
    assert args.generation_kwargs == {"max_new_tokens": 6} and not args.gradient_checkpointing
    (e,) = bench.run_eval(bench.cell_config("tiny", 0), [ck["path"]], base=False)
    assert e["n"] == 4


def _rec(side, mark, seed, k, steps=3):
    return {"side": side, "seed": seed, "mark_min": mark, "steps": steps, "train_s": 60.0 * mark,
            "heldout": bench._side(k, 64), "command": "bench/bench_trl_tta.py --marks 2,5 --seeds 0,1",
            "trl": "1.16.0", "torch": "2", "dtype": "auto", "threads": 2, "commit": "abc"}


def test_table_and_report_section(tmp_path):
    recs = [_rec("untrained", 0.0, 0, 0)] + [_rec(s, m, seed, k) for s, m, seed, k in [
        ("trl", 2.0, 0, 4), ("trl", 2.0, 1, 8), ("trajgrad", 2.0, 0, 40), ("trajgrad", 2.0, 1, 50)]]
    text = bench.table(recs)
    assert "4/64" in text and "50/64" in text and "9.4%" in text and "70.3%" in text  # means 6/64, 45/64
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in recs))
    md = tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\n## A\n\ntext\n\n## Learning benchmark\n\nrows\n")
    bench.write_report(results, md)
    bench.write_report(results, md)  # rebuilt in place, once
    body = md.read_text()
    assert body.count(bench.SECTION) == 1 and body.index("## A") < body.index(bench.SECTION) < body.index(
        "## Learning benchmark")
    assert "Not matched" in body and "advantage std" in body and body.rstrip().endswith("rows")


def test_untrained_repeats_are_one_row():
    """The untrained weights are evaluated once per run; the same result is not shown as several rows."""
    recs = [_rec("untrained", 0.0, 0, 0), _rec("untrained", 0.0, 1, 0), _rec("trl", 2.0, 0, 4),
            _rec("trajgrad", 2.0, 0, 40)]
    recs[1]["commit"] = "def"
    text = bench.table(recs)
    assert text.count("untrained") == 2 and "evaluated 2 times" in text  # one row, both sides' columns
    recs.append(_rec("untrained", 0.0, 2, 1))  # a different result keeps its own row
    assert bench.table(recs).count("| 0 | all |") == 2
    assert "commit abc, def;" in bench.report_markdown(recs)
