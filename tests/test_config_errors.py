"""Every bad config or CLI input of ``trajgrad train`` fails at load time, in one line.

Each case runs the real command line (in process) in an empty working directory and checks:
exit status 2, exactly one output line, ``error: <dotted key>: ...``, no traceback, and
nothing created on disk (no run directory, no ``runs/``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trajgrad.cli import app

runner = CliRunner()
T = ["--preset", "tiny"]


def S(*items):
    out = []
    for item in items:
        out += ["--set", item]
    return out


# (id, argv after "train" ({d} is the working directory), files to create first, dotted key the error names)
CASES = [
    # strict types, finite numbers, value domains
    ("bool-for-int", T + S("train.steps=true"), {}, "train.steps"),
    ("float-for-int", T + S("train.steps=1.5"), {}, "train.steps"),
    ("string-for-int", T + S('train.steps="3"'), {}, "train.steps"),
    ("negative-steps", T + S("train.steps=-1"), {}, "train.steps"),
    ("negative-keep-freed", T + S("train.keep_freed_mb=-1"), {}, "train.keep_freed_mb"),
    ("lr-inf", T + S("optim.lr=.inf"), {}, "optim.lr"),
    ("lr-nan", T + S("optim.lr=.nan"), {}, "optim.lr"),
    ("lr-negative", T + S("optim.lr=-1"), {}, "optim.lr"),
    ("betas-short", T + S("optim.betas=[0.9]"), {}, "optim.betas"),
    ("betas-long", T + S("optim.betas=[0.9,0.99,0.9]"), {}, "optim.betas"),
    ("betas-out-of-range", T + S("optim.betas=[0.9,1.5]"), {}, "optim.betas"),
    ("grad-clip-zero", T + S("optim.grad_clip=0"), {}, "optim.grad_clip"),
    ("unknown-key", T + S("train.stpes=3"), {}, "train.stpes"),
    ("unknown-section", T + S("trian.steps=3"), {}, "trian"),
    ("section-as-scalar", T + S("train=3"), {}, "train"),
    ("bad-literal-model", T + S("model.name=gpt5"), {}, "model.name"),
    ("bad-literal-dtype", T + S("model.dtype=float16"), {}, "model.dtype"),
    ("top-p-above-one", T + S("sampling.top_p=1.5"), {}, "sampling.top_p"),
    ("negative-temperature", T + S("sampling.temperature=-1"), {}, "sampling.temperature"),
    ("keep-zero", T + S("checkpoint.keep=0"), {}, "checkpoint.keep"),
    ("bool-field-int", T + S("log.tensorboard=3"), {}, "log.tensorboard"),
    ("name-with-slash", T + S("name=a/b"), {}, "name"),
    ("constraint-budget-inf", T + S("constraint.enabled=true", "constraint.budget=.inf"), {}, "constraint.budget"),
    # recipe and its overrides
    ("unknown-recipe", T + S("recipe.name=nope"), {}, "recipe.name"),
    ("eps-low-5", T + S("recipe.overrides.eps_low=5"), {}, "recipe.overrides.eps_low"),
    ("eps-low-1", T + S("recipe.overrides.eps_low=1"), {}, "recipe.overrides.eps_low"),
    ("eps-low-negative", T + S("recipe.overrides.eps_low=-0.1"), {}, "recipe.overrides.eps_low"),
    ("eps-high-inf", T + S("recipe.overrides.eps_high=.inf"), {}, "recipe.overrides.eps_high"),
    ("eps-low-bool", T + S("recipe.overrides.eps_low=true"), {}, "recipe.overrides.eps_low"),
    ("override-typo", T + S("recipe.overrides.eps_hihg=0.3"), {}, "recipe.overrides.eps_hihg"),
    ("gamma-above-one", T + S("recipe.overrides.gamma=2"), {}, "recipe.overrides.gamma"),
    ("dual-clip-below-one", T + S("recipe.overrides.dual_clip=0.5"), {}, "recipe.overrides.dual_clip"),
    ("kl-coef-without-placement", T + S("recipe.overrides.kl_coef=0.1"), {}, "recipe.overrides.kl_coef"),
    ("group-size-one", T + S("train.group_size=1"), {}, "train.group_size"),
    ("sao-eps-low-2", ["--preset", "sao-tiny"] + S("recipe.overrides.eps_low=2"), {}, "recipe.overrides.eps_low"),
    # options that have no effect in the chosen mode
    ("beta-without-dpo", T + S("recipe.overrides.beta=0.5"), {}, "recipe.overrides.beta"),
    ("tau-without-sapo", T + S("recipe.overrides.tau_pos=2"), {}, "recipe.overrides.tau_pos"),
    ("eps-with-sapo", T + S("recipe.name=sapo", "recipe.overrides.eps_low=0.1"), {}, "recipe.overrides.eps_low"),
    ("async-disabled", T + S("asynchronous.workers=4"), {}, "asynchronous.workers"),
    ("ray-address-disabled", T + ["--ray-address", "127.0.0.1:6379"], {}, "asynchronous.ray_address"),
    ("base-url-with-hf", T + S("rollout.base_url=http://127.0.0.1:8000"), {}, "rollout.base_url"),
    ("constraint-disabled", T + S("constraint.budget=0.5"), {}, "constraint.budget"),
    ("critic-without-critic", T + S("critic.lr=0.1"), {}, "critic.lr"),
    ("during-n-without-eval", T + S("eval.during_n=5"), {}, "eval.during_n"),
    ("top-k-greedy", T + S("sampling.temperature=0", "sampling.top_k=5"), {}, "sampling.top_k"),
    ("sft-lr-without-sft", T + S("sft.steps=0", "sft.lr=0.1"), {}, "sft.lr"),
    ("tries-without-dynamic", T + S("train.dynamic_sampling_max_tries=5"), {}, "train.dynamic_sampling_max_tries"),
    ("skip-switch-without-effect", T + S("recipe.name=dro", "train.skip_zero_gradient_rows=false"), {},
     "train.skip_zero_gradient_rows"),
    ("eval-without-evaluation", T + S("eval.after=false", "eval.before=false", "eval.n=10"), {}, "eval.n"),
    ("keep-without-checkpoints", T + S("checkpoint.every=0", "checkpoint.keep=5"), {}, "checkpoint.keep"),
    ("override-dict-eps-low", T + S("recipe.overrides={eps_low: 5}"), {}, "recipe.overrides.eps_low"),
    ("tiny-fields-smollm2", S("model.tiny.layers=3"), {}, "model.tiny.layers"),
    # models, task options and task size: named by the section they belong to
    ("tiny-heads", T + S("model.tiny.heads=5"), {}, "model.tiny.hidden_size"),
    ("tiny-hidden-too-small", T + S("model.tiny.hidden_size=4"), {}, "model.tiny.hidden_size"),
    ("tiny-odd-head", T + S("model.tiny.hidden_size=36", "model.tiny.heads=4"), {}, "model.tiny.hidden_size"),
    ("tiny-layers-zero", T + S("model.tiny.layers=0"), {}, "model.tiny.layers"),
    ("teacher-smollm2-tiny", T + S("recipe.name=opd", "teacher.name=smollm2"), {}, "teacher.name"),
    ("openai-without-url", T + S("rollout.backend=openai"), {}, "rollout.base_url"),
    ("unknown-task", T + S("task.name=nope"), {}, "task.name"),
    ("unknown-task-option", T + S("task.options.foo=1"), {}, "task.options.foo"),
    ("task-option-bool-for-int", T + S("task.options.max_turns=true"), {}, "task.options.max_turns"),
    ("task-option-zero-turns", T + S("task.options.max_turns=0"), {}, "task.options.max_turns"),
    ("task-option-operators", T + S("task.options.operators=/"), {}, "task.options.operators"),
    ("task-option-fraction", T + S("task.options.heldout_fraction=1.5"), {}, "task.options.heldout_fraction"),
    ("task-option-nan", T + S("task.options.format_bonus=.nan"), {}, "task.options.format_bonus"),
    ("task-option-operands", T + S("task.options.min_operand=50"), {}, "task.options.min_operand"),
    ("eval-n-too-many", T + S("eval.n=100000"), {}, "eval.n"),
    ("heldout-too-many", T + S("task.n_heldout=100000"), {}, "task.n_heldout"),
    ("train-too-many", T + S("task.n_train=100000"), {}, "task.n_train"),
    ("during-n-above-n", T + S("eval.every=5", "eval.n=10", "eval.during_n=20"), {}, "eval.during_n"),
    ("latency-missing-sigma", ["--preset", "sao-tiny"] + S("asynchronous.env_latency={mu: 0.0}"), {},
     "asynchronous.env_latency"),
    # --set syntax
    ("set-yaml-syntax", T + S("train.steps=[1"), {}, "train.steps"),
    ("set-without-equals", T + S("train.steps"), {}, "--set"),
    ("set-bad-key", T + S("train..steps=3"), {}, "--set"),
    ("set-twice", T + S("train.steps=3", "train.steps=4"), {}, "train.steps"),
    ("unknown-preset", ["--preset", "nope"], {}, "preset"),
    # the CONFIG file
    ("config-is-directory", ["{d}/cfgdir"], {"cfgdir/": None}, "config"),
    ("config-missing", ["{d}/missing.yaml"], {}, "config"),
    ("config-yaml-syntax", ["{d}/c.yaml"], {"c.yaml": "train:\n  steps: [1\n"}, "config"),
    ("config-duplicate-key", ["{d}/c.yaml"], {"c.yaml": "preset: tiny\ntrain:\n  steps: 3\n  steps: 4\n"}, "train.steps"),
    ("config-top-level-list", ["{d}/c.yaml"], {"c.yaml": "- 1\n- 2\n"}, "config"),
    ("config-section-scalar", ["{d}/c.yaml"], {"c.yaml": "preset: tiny\ntrain: 3\n"}, "train"),
    ("config-unknown-preset", ["{d}/c.yaml"], {"c.yaml": "preset: nope\n"}, "preset"),
    ("config-eps-low", ["{d}/c.yaml"], {"c.yaml": "preset: tiny\nrecipe:\n  overrides: {eps_low: 5}\n"},
     "recipe.overrides.eps_low"),
    ("config-bool-steps", ["{d}/c.yaml"], {"c.yaml": "preset: tiny\ntrain: {steps: yes}\n"}, "train.steps"),
    # the run directory and the resume flags
    ("run-dir-is-file", T + ["--run-dir", "{d}/afile"], {"afile": "x"}, "run_dir"),
    ("run-dir-under-file", T + ["--run-dir", "{d}/afile/sub"], {"afile": "x"}, "run_dir"),
    ("run-dir-not-empty", T + ["--run-dir", "{d}/full"], {"full/notes.txt": "mine"}, "run_dir"),
    ("overwrite-foreign-dir", T + ["--run-dir", "{d}/full", "--overwrite"], {"full/notes.txt": "mine"}, "run_dir"),
    ("resume-missing", ["--resume", "{d}/nothing"], {}, "resume"),
    ("resume-not-a-run", ["--resume", "{d}/full"], {"full/notes.txt": "mine"}, "resume"),
    ("resume-a-file", ["--resume", "{d}/afile"], {"afile": "x"}, "resume"),
    ("resume-and-overwrite", ["--resume", "{d}/full", "--overwrite"], {"full/notes.txt": "mine"}, "overwrite"),
    ("allow-change-without-resume", T + ["--allow-config-change"], {}, "allow_config_change"),
    ("checkpoint-without-resume", T + ["--checkpoint", "step-000001"], {}, "checkpoint"),
]


def _listing(root: Path):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("argv,files,key", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_in_one_line_naming_the_key(tmp_path, monkeypatch, argv, files, key):
    work = tmp_path / "work"
    work.mkdir()
    for rel, content in files.items():
        path = work / rel
        if content is None:
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    before = _listing(tmp_path)
    monkeypatch.chdir(work)
    res = runner.invoke(app, ["train", *[a.replace("{d}", str(work)) for a in argv]])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), repr(res.exception)  # not an uncaught exception
    assert "Traceback" not in res.output
    assert len(lines) == 1, res.output
    assert lines[0].startswith(f"error: {key}") or f" {key}:" in lines[0] or lines[0].startswith("error: " + key), \
        lines[0]
    assert _listing(tmp_path) == before  # nothing created or changed on disk


def test_at_least_56_cases():
    assert len(CASES) >= 56
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv", [["--preset", "tiny", "--set", "train.steps=[1"], ["{d}"],
                                  ["--preset", "tiny", "--set", "eval.n=100000"]])
def test_real_process_prints_one_line_without_traceback(tmp_path, argv):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "trajgrad", "train", *[a.replace("{d}", str(tmp_path)) for a in argv]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []
