"""Held-out evaluation counts distinct tasks (prompt and answer after rendering): asking for more
is refused at load (or, with eval.distinct: warn, only the distinct ones are evaluated), and the
count is always printed."""
import json

import pytest

from trajgrad.envs import get_task_source
from trajgrad.train.config import load_config
from trajgrad.train.heldout import distinct_tasks
from trajgrad.train.presets import PRESETS
from trajgrad.train.setup import build_tasks

ME = __name__


def exact(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def _files(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    held = tmp_path / "held.jsonl"  # 26 rows, 3 distinct prompts
    held.write_text("".join(json.dumps({"prompt": f"{k}+2=", "answer": str(k + 2)}) + "\n"
                            for k in [i % 3 for i in range(26)]))
    return {"task.dataset": str(train), "task.heldout": str(held), "task.reward": f"{ME}:exact", "sft.steps": 0}


def test_more_heldout_tasks_than_distinct_ones_is_refused_at_load(tmp_path):
    with pytest.raises(ValueError) as e:
        load_config(preset="tiny", overrides=_files(tmp_path))  # the preset's n_heldout: 128
    assert str(e.value) == ("task.n_heldout: asks for 128 held-out tasks; task 'dataset' has 3 distinct held-out "
                            "tasks (prompt and answer after rendering): set it to 3, or eval.distinct: warn to "
                            "evaluate the 3 distinct held-out tasks")
    with pytest.raises(ValueError, match=r"^eval\.n: asks for 5 held-out tasks; task 'dataset' has 3"):
        load_config(preset="tiny", overrides={**_files(tmp_path), "eval.n": 5})
    assert load_config(preset="tiny", overrides={**_files(tmp_path), "task.n_heldout": 3}).task.n_heldout == 3
    # a run that never evaluates is not refused for its held-out count
    load_config(preset="tiny", overrides={**_files(tmp_path), "eval.before": False, "eval.after": False})


def test_warn_evaluates_the_distinct_tasks_and_says_how_many(tmp_path):
    cfg = load_config(preset="tiny", overrides={**_files(tmp_path), "eval.distinct": "warn"})
    lines = []
    _, _, held = build_tasks(cfg, lines.append)
    assert sorted(t.prompt for t in held) == ["0+2=", "1+2=", "2+2="]
    assert lines == ["held-out: 3 distinct tasks of the 128 asked for (task.n_heldout); evaluating the 3 distinct "
                     "ones (eval.distinct: warn)"]
    cfg = load_config(preset="tiny", overrides={**_files(tmp_path), "task.n_heldout": 3})
    lines.clear()
    assert len(build_tasks(cfg, lines.append)[2]) == 3 and lines == ["held-out: 3 distinct tasks (task.n_heldout)"]


def test_same_question_with_different_hidden_answers_are_distinct():
    src = get_task_source("guess")
    tasks = src.tasks("heldout", 200, 0)
    assert len({t.prompt for t in tasks}) == 1  # one question for every task
    assert len(distinct_tasks(src, tasks)) == len({t.answer for t in tasks}) > 1


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_ask_for_distinct_heldout_tasks_only(preset):
    cfg = load_config(preset=preset)
    src = get_task_source(cfg.task.name, **cfg.task.options)
    tasks = src.tasks("heldout", cfg.task.n_heldout, cfg.task.seed)
    assert len(distinct_tasks(src, tasks)) == cfg.task.n_heldout
