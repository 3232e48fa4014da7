"""Time-to-accuracy on the calculator main job: TRL 1.16's GRPOTrainer (its own tool loop) against trajgrad's GRPO.

One run trains, for each seed, both sides one after the other (each in its own subprocess,
never concurrently; the order alternates between seeds) from the ``default`` preset
(``trajgrad train``: SmolLM2-135M-Instruct + LoRA r=8 on q/k/v/o, GRPO, 8 prompts x 4
samples, temperature 0.7, 32 new tokens per turn, lr 5e-4, the calculator env with its
``<calc>`` tool protocol, two turns). Each side keeps its LoRA weights at wall-time marks
(``--marks 2,5``: minutes of training wall time, from the start of the training loop,
model loading and evaluation excluded): the weights after the last optimizer step that
ended by the mark. Then every checkpoint of both sides, and the untrained model once, is
scored by trajgrad's own evaluator (the one ``trajgrad train`` reports held-out success
with: greedy, the preset's 64 held-out calculator tasks, trajgrad's env and tool loop), in
a third subprocess. Printed: held-out success k/64 with 95% Wilson intervals per side,
mark and seed, and the means; each checkpoint's record is appended to
``bench/results/trl_tta.jsonl`` (``--results``); ``--report`` rebuilds the section
"## Time-to-accuracy against TRL" of ``bench/RESULTS.md`` from that file::

    PYTHONPATH=$PWD/src .venv-peers/bin/python bench/bench_trl_tta.py --marks 2,5 --seeds 0,1,2
    PYTHONPATH=$PWD/src .venv-peers/bin/python bench/bench_trl_tta.py --report
    PYTHONPATH=$PWD/src .venv-peers/bin/python bench/bench_trl_tta.py --marks 2,5 --seeds 0 --trl-loops env,calc
    PYTHONPATH=$PWD/src .venv-peers/bin/python bench/bench_trl_tta.py --workload tiny --marks 0.05 --seeds 0

(``.venv-peers``: ``make peers``, pinned trl layered on ``.venv``.) ``--workload tiny``: a
random tiny Llama with a character tokenizer on the same protocol, a smoke run of the harness.

TRL's side uses TRL's own multi-turn tool loop: ``GRPOTrainer(environment_factory=...)``,
each rollout's environment being trajgrad's ``CalculatorEnv`` behind a tool method, and the
reward the env's own episode return (``bench/_trl_tool_loop.py``), in one of two ways
(``--trl-loops env``, the default, or ``calc``, or both: ``env,calc``, each its own side):

* ``env`` (side ``trl``): every turn that does not end the episode is the tool call
  ``step(action=TURN)`` and the env's observation is the tool message: the env's protocol
  turn for turn through TRL's loop (what a turn is, is asked of the env);
* ``calc`` (side ``trl-calc``): the calculator is the tool ``calc(expression)``, parsed from a
  complete ``<calc>`` tag; a turn without a tool call ends the episode, TRL's tool semantics
  (untrained SmolLM2 mostly writes a made-up ``<result>`` first: the env would answer with an
  error message and a second turn; TRL's calc loop ends there with return 0).
Matched: the model and its weights (the same loader, dtype and LoRA targets, r, alpha,
dropout), the task pool (the same 4000 training tasks), the prompts (the env's own reset
messages through SmolLM2's chat template), prompts per step x group size (8 x 4: one
generation batch of 32 per optimizer step, micro-batches of 8), one optimizer step per
batch (``num_iterations=1``), AdamW (lr, betas, no weight decay, constant schedule, no
warm-up, gradient clipping at norm 1.0), temperature 0.7 with no top-k/top-p, 32 new
tokens per turn (``generation_kwargs``), at most one tool call per episode (the env's two
turns), per-sequence token-mean then mean over sequences (TRL ``loss_type="grpo"`` =
trajgrad ``seq_mean_token_mean``), advantages normalized by the group's std
(``scale_rewards="group"``), ratio clip 0.2, no KL term (``beta=0``), no autocast.

Not matched (printed by every run and in the report, :data:`UNMATCHED` and :data:`LOOP_NOTES`):
the tool-call format (a template and parser for the tag protocol, as TRL has none for
SmolLM2), a turn cut at the token limit (trajgrad closes it with ``<|im_end|>``), the
advantage's std (TRL: unbiased + 1e-4, no option for trajgrad's population std + 1e-6), the
order of training tasks, the sampler (transformers' generate vs trajgrad's) and what each
trainer's wall time includes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _trl_tool_loop import (CalculatorTools, EnvTurns, env_reward, env_turn_parser, tag_response_template,  # noqa: E402
                            tag_tool_template)
from bench_learning import _commit, _load  # noqa: E402

from trajgrad.stats import wilson_interval  # noqa: E402
from trajgrad.train.config import load_config  # noqa: E402

RESULTS = HERE / "results" / "trl_tta.jsonl"
SECTION = "## Time-to-accuracy against TRL"
# TRL's tool loops (``--trl-loops``): the side's name -> the loop
TRL_LOOPS = {"env": "trl", "calc": "trl-calc"}
SIDES = ("trl", "trl-calc", "trajgrad")
TITLES = {"trl": "TRL GRPOTrainer, env loop", "trl-calc": "TRL GRPOTrainer, calc loop", "trajgrad": "trajgrad GRPO"}

# Per workload: config overrides on the ``default`` preset.
WORKLOADS: Dict[str, Dict[str, Any]] = {
    "smollm2": {},
    "tiny": {"model": {"name": "tiny", "dtype": "float32", "lora": {"r": 8, "alpha": 16},
                       "tiny": {"hidden_size": 32, "layers": 1, "heads": 2, "seed": 0}},
             "sampling.max_new_tokens": 6, "train.prompts_per_step": 2, "train.group_size": 2,
             "train.micro_batch_size": 2, "task.n_train": 64, "task.n_heldout": 4, "eval.during_n": None},
}

UNMATCHED = [
    "tool-call format: TRL runs tools only through the chat template and a response parser; SmolLM2's ChatML "
    "template renders no tool calls (TRL refuses it) and TRL has no parser for it. Its loop runs here with a "
    "template that renders a tool call and a tool message as the env's turns (`<calc>EXPRESSION</calc>` or the "
    "turn's text; a user message `<result>VALUE</result>`) and a parser for the env's protocol "
    "(bench/_trl_tool_loop.py): the tokens the model sees are trajgrad's, the loop is TRL's",
    "a turn cut at 32 tokens: trajgrad closes it with <|im_end|> (not trained) before the next message; TRL "
    "appends the tool message right after the cut tokens",
    "advantage std: TRL divides by the unbiased group std (1/(G-1)) + 1e-4, trajgrad's GRPO by the population "
    "std (1/G) + 1e-6 (TRL has no option for the population std): with G=4 TRL's advantages are 0.87x trajgrad's",
    "order of training tasks: the same 4000 tasks, drawn in each trainer's own order (TRL's sampler, seeded)",
    "sampling: TRL samples with transformers' generate (its own RNG stream, left padding), trajgrad with its "
    "own sampler; the same temperature and limits, different draws",
    "wall time: TRL's trainer.train() from its start (accelerate setup, dataloader) to each step's end; "
    "trajgrad's Trainer.run() likewise (its per-token and trajectory logs included); model loading excluded on both",
]
# What each TRL loop does differently from the env's protocol.
LOOP_NOTES = {
    "trl": "TRL (env loop): a turn is the tool call `step(action=TURN)` unless the env ends the episode on it (its "
           "first action is an answer; the tokenizer's parse_response replaced by one that asks the env), and the "
           "env's observation is the tool message: the env's protocol turn for turn",
    "trl-calc": "TRL (calc loop): the calculator is the tool `calc(expression)`, parsed from a complete `<calc>` "
                "tag not preceded by an `<answer>` tag; a turn without a tool call ends the episode (TRL's tool "
                "semantics), where the env answers a turn without an action with an error message and gives the "
                "second turn: such episodes score their return so far (0), counted as ended_before_env",
}


def cell_config(workload: str, seed: int, dtype: Optional[str] = None):
    """The ``default`` preset with the workload's overrides, for seed ``seed``: no evaluation
    or checkpoint during the run, no step limit (the marks end it)."""
    if workload not in WORKLOADS:
        raise ValueError(f"--workload: unknown {workload!r}; known: {', '.join(WORKLOADS)}")
    over = {**WORKLOADS[workload], "name": f"trl-tta-{workload}-s{seed}", "train.seed": int(seed),
            "train.steps": 100000, "eval.before": False, "eval.after": False, "checkpoint.every": 0,
            "log.progress": False, "log.tensorboard": False}
    if dtype is not None:
        over["model.dtype"] = dtype
    return load_config(preset="default", overrides=over)


def parse_marks(text: str) -> List[float]:
    try:
        marks = sorted({float(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--marks: expected minutes separated by commas, e.g. 2,5,10; got {text!r}") from None
    if not marks or marks[0] <= 0:
        raise ValueError(f"--marks: expected positive minutes, got {text!r}")
    return marks


def parse_seeds(text: str) -> List[int]:
    try:
        seeds = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds: expected integers separated by commas, e.g. 0,1,2; got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: expected distinct seeds, got {text!r}")
    return seeds


def trl_sides(text: str) -> List[str]:
    """The TRL sides of ``--trl-loops`` (e.g. ``env,calc``)."""
    loops = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [x for x in loops if x not in TRL_LOOPS]
    if not loops or bad or len(set(loops)) != len(loops):
        raise ValueError(f"--trl-loops: expected some of {', '.join(TRL_LOOPS)} separated by commas, got {text!r}")
    return [TRL_LOOPS[x] for x in loops]


def lora_state(model) -> Dict[str, Any]:
    """The LoRA weights of ``model`` (``lora_`` in the name), detached copies."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    if not state:
        raise ValueError("model: no LoRA weights (model.lora must be set on both sides)")
    return state


class MarkKeeper:
    """Training wall time and the weights at each mark.

    ``start()`` when the training loop starts; ``step_done(model, step)`` after each optimizer
    step. A mark's checkpoint is the weights after the last step that ended by the mark (the
    untrained weights when none did); time spent here (copying, saving) is not training time.
    Returns True once the last mark has passed.
    """

    def __init__(self, marks_min: Sequence[float], out_dir: Path, side: str, seed: int, model) -> None:
        self.marks = [float(m) for m in marks_min]
        self.out_dir, self.side, self.seed = Path(out_dir), side, int(seed)
        self.prev = (0, 0.0, lora_state(model))
        self.saved: Dict[float, Dict[str, Any]] = {}
        self.ends: List[float] = []  # training seconds at the end of each step
        self.paused = 0.0
        self.t0: Optional[float] = None

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    def _save(self, mark: float, step: int, train_s: float, state) -> None:
        path = self.out_dir / f"{self.side}-s{self.seed}-m{mark:g}.pt"
        import torch

        torch.save({"state": state, "step": step, "train_s": train_s, "mark_min": mark}, path)
        self.saved[mark] = {"path": str(path), "steps": step, "train_s": round(train_s, 1), "mark_min": mark}

    def step_done(self, model, step: int) -> bool:
        el = self.elapsed()
        t = time.perf_counter()
        self.ends.append(round(el, 1))
        for m in self.marks:
            if m not in self.saved and el > 60 * m:
                self._save(m, *self.prev)
        self.prev = (step, el, lora_state(model))
        done = el >= 60 * self.marks[-1]
        if done:
            for m in self.marks:
                if m not in self.saved:
                    self._save(m, *self.prev)
        self.paused += time.perf_counter() - t
        return done


# ------------------------------------------------------------------------------------ the sides


def run_trajgrad(cfg, marks, out_dir: Path) -> Dict[str, Any]:
    """trajgrad's Trainer on ``cfg`` until the last mark."""
    from trajgrad.train.trainer import Trainer

    class Marked(Trainer):
        def run(self):
            self.keeper.start()
            return super().run()

        def train_step(self):
            metrics = super().train_step()
            if self.keeper.step_done(self.model, self.step + 1):
                self.cfg.train.steps = self.step + 1
            return metrics

    run_dir = Path(tempfile.mkdtemp(prefix="trl_tta_trajgrad_"))
    tr = Marked(cfg, run_dir, console=lambda *a: None)
    tr.keeper = MarkKeeper(marks, out_dir, "trajgrad", cfg.train.seed, tr.model)
    tr.run()
    return {"checkpoints": list(tr.keeper.saved.values()), "steps_run": tr.keeper.prev[0],
            "step_ends_s": tr.keeper.ends, "run_dir": str(run_dir)}


def trl_args(cfg, output_dir: str):
    """TRL's GRPOConfig with trajgrad's settings (see the module docstring for what cannot match)."""
    from trl import GRPOConfig

    from trajgrad.objective import get_recipe

    obj = get_recipe(cfg.recipe.name, **cfg.recipe.overrides)
    if obj.aggregation != "seq_mean_token_mean" or obj.advantage != "group_std" or obj.kl_placement != "none":
        raise ValueError(f"recipe: the TRL mapping covers GRPO with seq_mean_token_mean, group std and no KL; "
                         f"got {obj.aggregation}, {obj.advantage}, {obj.kl_placement}")
    P, G, micro = cfg.train.prompts_per_step, cfg.train.group_size, cfg.train.micro_batch_size
    if (P * G) % micro:
        raise ValueError(f"train.micro_batch_size: {micro} must divide prompts x group size {P * G}")
    L, turns = cfg.sampling.max_new_tokens, int(cfg.task.options.get("max_turns", 4))
    return GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=P * G // micro,
        num_generations=G, max_completion_length=turns * L + 64 * (turns - 1),
        generation_kwargs={"max_new_tokens": L}, max_tool_calling_iterations=turns - 1,
        learning_rate=cfg.optim.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.betas[0], adam_beta2=cfg.optim.betas[1],
        max_grad_norm=cfg.optim.grad_clip if cfg.optim.grad_clip is not None else 1e12,
        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p or 1.0, top_k=cfg.sampling.top_k or 0,
        beta=0.0, num_iterations=cfg.train.epochs_per_batch, epsilon=obj.eps_low,
        epsilon_high=obj.eps_high if obj.eps_high is not None else obj.eps_low, loss_type="grpo",
        scale_rewards="group", max_steps=cfg.train.steps, seed=cfg.train.seed, use_cpu=True, bf16=False,
        gradient_checkpointing=cfg.model.gradient_checkpointing, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)


def run_trl(cfg, marks, out_dir: Path, loop: str = "env") -> Dict[str, Any]:
    """TRL's GRPOTrainer with its own tool loop (``loop``: ``env`` or ``calc``, :data:`TRL_LOOPS`) on the
    same model, tasks and env, until the last mark."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from trajgrad.envs import get_task_source
    from trajgrad.model.build import build_model, lora_target_modules

    m = cfg.model
    model, tok = build_model(m.name, path=m.path, dtype=m.dtype, tiny_hidden_size=m.tiny.hidden_size,
                             tiny_layers=m.tiny.layers, tiny_heads=m.tiny.heads, tiny_seed=m.tiny.seed, lora=None,
                             train=True)
    lora = m.lora
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules or lora_target_modules(model)), task_type="CAUSAL_LM")
    if loop not in TRL_LOOPS:
        raise ValueError(f"--trl-loops: unknown {loop!r}; known: {', '.join(TRL_LOOPS)}")
    source = get_task_source(cfg.task.name, **cfg.task.options)
    tok.chat_template = tag_tool_template(tok.chat_template)
    tok.response_template = tag_response_template("calc", end_of_turn=tok.eos_token)
    if loop == "env":  # the env decides what a turn is (the response template stays for TRL's checks)
        tok.parse_response = env_turn_parser(tok, source)
    tok.padding_side = "left"
    tasks = source.tasks("train", cfg.task.n_train, cfg.task.seed)
    env0 = source.make_env()
    ds = Dataset.from_dict({"prompt": [env0.reset(t) for t in tasks],
                            "task": [json.dumps({"id": t.id, "split": t.split, "prompt": t.prompt, "answer": t.answer,
                                                 "metadata": t.metadata}) for t in tasks]})
    keeper_box: Dict[str, MarkKeeper] = {}

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            keeper_box["k"] = MarkKeeper(marks, out_dir, TRL_LOOPS[loop], cfg.train.seed, model)
            keeper_box["k"].start()

        def on_step_end(self, args, state, control, model=None, **kw):
            if keeper_box["k"].step_done(model, state.global_step):
                control.should_training_stop = True

    args = trl_args(cfg, tempfile.mkdtemp(prefix="trl_tta_trl_"))
    episode = EnvTurns if loop == "env" else CalculatorTools
    trainer = GRPOTrainer(model=model, reward_funcs=env_reward, args=args, train_dataset=ds, processing_class=tok,
                          peft_config=peft_config, environment_factory=lambda: episode(source),
                          callbacks=[Marks()])
    trainer.train()
    k = keeper_box["k"]
    return {"checkpoints": list(k.saved.values()), "steps_run": k.prev[0], "step_ends_s": k.ends,
            "protocol": dict(episode.counts)}


def run_eval(cfg, paths: Sequence[str], base: bool) -> List[Dict[str, Any]]:
    """trajgrad's held-out evaluation (``Trainer.evaluate``) of the untrained model (``base``)
    and of each checkpoint's LoRA weights."""
    import torch

    from trajgrad.train.trainer import Trainer

    tr = Trainer(cfg, Path(tempfile.mkdtemp(prefix="trl_tta_eval_")), console=lambda *a: None)
    want = set(lora_state(tr.model))
    out = []
    jobs = ([None] if base else []) + list(paths)
    for path in jobs:
        if path is not None:
            ck = torch.load(path, map_location="cpu")
            if set(ck["state"]) != want:
                diff = sorted(set(ck["state"]) ^ want)[:4]
                raise ValueError(f"{path}: its LoRA weights do not match the evaluation model's (e.g. {diff})")
            missing, unexpected = tr.model.load_state_dict(ck["state"], strict=False)
            assert not unexpected and not (want & set(missing)), (unexpected, missing)
        t = time.perf_counter()
        res = tr.evaluate("after")
        out.append({"path": path, "successes": res.successes, "n": res.n, "reward": round(res.reward, 4),
                    "eval_s": round(time.perf_counter() - t, 1)})
    return out


# ------------------------------------------------------------------------------------ the run


def _subprocess(args: List[str], threads: int) -> Dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve())] + args, capture_output=True, text=True, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        print(out.stdout[-3000:], out.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"bench_trl_tta: the subprocess {' '.join(args[:2])} failed (exit {out.returncode})")
    return json.loads(line[-1][len("RESULT "):])


def _side(successes: int, n: int) -> Dict[str, Any]:
    low, high = wilson_interval(successes, n)
    return {"successes": successes, "n": n, "success": successes / n, "low": low, "high": high}


def run_all(a) -> List[Dict[str, Any]]:
    """Every seed: both sides' training, then the evaluation of their checkpoints; records appended."""
    import torch
    import trl

    marks, seeds = parse_marks(a.marks), parse_seeds(a.seeds)
    sides = trl_sides(a.trl_loops) + ["trajgrad"]
    ck_dir = Path(a.ckpt_dir or tempfile.mkdtemp(prefix="trl_tta_ckpts_"))
    ck_dir.mkdir(parents=True, exist_ok=True)
    common = ["--marks", a.marks, "--workload", a.workload, "--ckpt-dir", str(ck_dir)] + (
        ["--dtype", a.dtype] if a.dtype else [])
    cfg = cell_config(a.workload, seeds[0], a.dtype)
    print("Not matched between the sides:\n" + "\n".join(f"  - {u}" for u in UNMATCHED + [
        LOOP_NOTES[x] for x in sides if x in LOOP_NOTES]), flush=True)
    cmd = " ".join(shlex.quote(x) for x in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    meta = {"workload": a.workload, "model": cfg.model.name, "dtype": cfg.model.dtype, "commit": _commit(),
            "trl": trl.__version__, "torch": torch.__version__, "threads": a.threads, "command": cmd}
    records: List[Dict[str, Any]] = []
    a.results.parent.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        order = sides if i % 2 == 0 else sides[::-1]  # alternate which side runs first
        trained = {}
        for side in order:
            load0 = _load()
            print(f"seed {seed}: training {side} to {marks[-1]:g} min ...", flush=True)
            trained[side] = _subprocess(["--side", side, "--seed", str(seed)] + common, a.threads)
            trained[side]["load"] = [load0, _load()]
        paths = [c["path"] for side in sides for c in trained[side]["checkpoints"]]
        base = a.base and i == 0
        print(f"seed {seed}: evaluating {len(paths)} checkpoints{' and the untrained model' if base else ''} ...",
              flush=True)
        evals = {e["path"]: e for e in _subprocess(["--side", "eval", "--seed", str(seed), "--paths", ",".join(paths)]
                                                   + (["--eval-base"] if base else []) + common, a.threads)["evals"]}
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        rows = []
        if base:
            e = evals[None]
            rows.append({**meta, "side": "untrained", "seed": seed, "mark_min": 0.0, "steps": 0, "train_s": 0.0,
                         "heldout": _side(e["successes"], e["n"]), "eval_s": e["eval_s"], "finished_utc": stamp})
        for side in sides:
            for c in trained[side]["checkpoints"]:
                e = evals[c["path"]]
                rec = {**meta, "side": side, "seed": seed, "mark_min": c["mark_min"], "steps": c["steps"],
                       "train_s": c["train_s"], "heldout": _side(e["successes"], e["n"]), "reward": e["reward"],
                       "eval_s": e["eval_s"], "load": trained[side]["load"], "finished_utc": stamp,
                       "step_ends_s": trained[side]["step_ends_s"]}
                if "protocol" in trained[side]:
                    rec["trl_protocol"] = trained[side]["protocol"]
                rows.append(rec)
        with open(a.results, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        records += rows
        print(table(records), flush=True)
    return records


def _pct(h: Dict[str, Any]) -> str:
    return f"{h['successes']}/{h['n']} ({h['low']:.0%}–{h['high']:.0%})"


def table(records: List[Dict[str, Any]]) -> str:
    """Markdown: one row per (mark, seed), TRL and trajgrad side by side; then the means per mark."""
    base = [r for r in records if r["side"] == "untrained"]
    by = {(r["side"], r["mark_min"], r["seed"]): r for r in records if r["side"] in SIDES}
    marks = sorted({k[1] for k in by})
    seeds = sorted({k[2] for k in by})
    sides = [x for x in SIDES if any(k[0] == x for k in by)]
    lines = ["| minutes | seed | " + " | ".join(f"{TITLES[x]}: held-out (95% CI) | steps | train s" for x in sides) + " |",
             "| ---: | ---: | " + " | ".join("---: | ---: | ---:" for _ in sides) + " |"]
    # the untrained weights are the same for every seed and run (greedy evaluation): one row per distinct
    # result, with how many evaluations gave it, rather than the same figure repeated
    outcomes = list(dict.fromkeys((b["heldout"]["successes"], b["heldout"]["n"]) for b in base))
    for k, n in outcomes:
        same = [b for b in base if (b["heldout"]["successes"], b["heldout"]["n"]) == (k, n)]
        times = f" (evaluated {len(same)} times, once per run)" if len(same) > 1 else ""
        lines.append("| 0 | all | " + " | ".join(f"untrained{times}: {_pct(same[0]['heldout'])} | 0 | 0"
                                                 for _ in sides) + " |")
    for m in marks:
        for s in seeds:
            cells = []
            for side in sides:
                r = by.get((side, m, s))
                cells += ([_pct(r["heldout"]), str(r["steps"]), f"{r['train_s']:.0f}"] if r else ["–", "", ""])
            lines.append(f"| {m:g} | {s} | " + " | ".join(cells) + " |")
        means = []
        for side in sides:
            rs = [by[(side, m, s)] for s in seeds if (side, m, s) in by]
            means += ([f"**{sum(r['heldout']['success'] for r in rs) / len(rs):.1%}** (mean of {len(rs)})",
                       f"{sum(r['steps'] for r in rs) / len(rs):.1f}", ""] if rs else ["–", "", ""])
        lines.append(f"| {m:g} | mean | " + " | ".join(means) + " |")
    return "\n".join(lines)


def report_markdown(records: List[Dict[str, Any]]) -> str:
    cmds = list(dict.fromkeys(r["command"] for r in records))
    first = records[0] if records else {}
    lines = [SECTION, "",
             "Held-out greedy success (trajgrad's evaluator, the default preset's 64 held-out calculator tasks) of "
             "SmolLM2-135M-Instruct + LoRA after the same training wall time, TRL's GRPOTrainer with its own "
             "tool loop (`environment_factory`) against trajgrad's GRPO, from the `default` preset's settings; a "
             "mark's checkpoint is the weights after the last optimizer step that ended by the mark (steps and "
             "exact training seconds listed). Model loading and evaluation are not training time.", ""]
    lines += [f"Command: `{c}`" for c in cmds] + [""]
    if first:
        commits = ", ".join(dict.fromkeys(r["commit"] for r in records))
        lines += [f"trl {first['trl']}, torch {first['torch']}, dtype {first['dtype']}, {first['threads']} threads, "
                  f"commit {commits}; the sides ran one after the other on a shared 2-core machine.", ""]
    present = [x for x in SIDES if any(r["side"] == x for r in records)]
    lines += [table(records), "", "Not matched between the sides:", ""] + [f"- {u}" for u in UNMATCHED] + [
        f"- {LOOP_NOTES[x]}" for x in present if x in LOOP_NOTES] + [""]
    for side in present:
        runs = {(r["seed"]): r["trl_protocol"] for r in records if r["side"] == side and r.get("trl_protocol")}
        if runs:
            lines += [f"{TITLES[side]}: tool calls {sum(p['tool_calls'] for p in runs.values())}, episodes "
                      f"{sum(p['episodes'] for p in runs.values())}, of which ended at a turn without a tool call where "
                      f"the env would have given another turn: {sum(p['ended_before_env'] for p in runs.values())} "
                      f"(the seeds' whole runs).", ""]
    lines += ["Rebuilt by `bench/bench_trl_tta.py --report` from `bench/results/trl_tta.jsonl`.", ""]
    return "\n".join(lines)


def write_report(results: Path, results_md: Path) -> str:
    """Write the section into ``results_md``: in place of the old one, else before the learning
    benchmark's section (which its report rewrites to the end of the file), else at the end."""
    records = [json.loads(x) for x in results.read_text().splitlines() if x.strip()] if results.exists() else []
    text = report_markdown(records)
    old = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
    if "\n" + SECTION + "\n" in old:
        head, rest = old.split("\n" + SECTION + "\n", 1)
        nxt = rest.find("\n## ")
        tail = rest[nxt + 1:] if nxt >= 0 else ""
    elif "\n## Learning benchmark\n" in old:
        head, tail = old.split("\n## Learning benchmark\n", 1)
        tail = "## Learning benchmark\n" + tail
    else:
        head, tail = old, ""
    results_md.write_text(head.rstrip("\n") + "\n\n" + text + ("\n" + tail if tail else ""))
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--marks", default="2,5", help="minutes of training wall time, e.g. 2,5,10")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workload", default="smollm2", choices=sorted(WORKLOADS))
    p.add_argument("--trl-loops", default="env", help="TRL's tool loops to run: env, calc or env,calc "
                   "(bench/_trl_tool_loop.py)")
    p.add_argument("--dtype", default=None, help="model.dtype on both sides (default: the preset's)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each subprocess")
    p.add_argument("--no-base", dest="base", action="store_false", help="skip the untrained model's evaluation")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--ckpt-dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--report", action="store_true", help="rebuild the section of bench/RESULTS.md from --results")
    p.add_argument("--side", choices=SIDES + ("eval",), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--paths", default="", help=argparse.SUPPRESS)
    p.add_argument("--eval-base", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:
        if a.report:
            print(write_report(a.results, HERE / "RESULTS.md"))
            return 0
        if a.side is None:
            run_all(a)
            return 0
        import torch

        torch.set_num_threads(a.threads)
        cfg = cell_config(a.workload, a.seed, a.dtype)
        if a.side == "eval":
            paths = [x for x in a.paths.split(",") if x]
            print("RESULT " + json.dumps({"evals": run_eval(cfg, paths, a.eval_base)}))
            return 0
        marks, out = parse_marks(a.marks), Path(a.ckpt_dir)
        loops = {side: loop for loop, side in TRL_LOOPS.items()}
        res = run_trajgrad(cfg, marks, out) if a.side == "trajgrad" else run_trl(cfg, marks, out, loops[a.side])
        print("RESULT " + json.dumps(res))
        return 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
