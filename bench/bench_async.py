"""SAO (asynchronous single rollouts on Ray) against synchronous grouped GRPO (§20.1).

Part 1, throughput under heavy-tailed environment latency. Every env.step sleeps
exp(Z), Z ~ N(mu, sigma^2) seconds (trajgrad.envs.latency; default mu = log(0.05),
sigma = 1.0: median 50 ms, mean 82 ms). The tiny random model on the calculator task
(3 turns per episode). Same machine, same number of rollout workers N, each running at
most one episode at a time; each variant trains for the same wall-clock budget:

* ``sao``         AsyncTrainer, sao recipe, one rollout per prompt, admitted when ready,
                  ``queue_size = 2N`` (one running + one queued episode per actor).
* ``sao-q1``      the same with ``queue_size = N`` (a worker idles between its episode
                  and the learner's next submission).
* ``grpo-ray``    GroupedRayTrainer: 1 prompt x G = 8 rollouts dispatched to the same N
                  actors, barrier, one update; W measured per group.
* ``grpo-local``  the existing in-process Trainer loop (batched generation, env steps of
                  the batch one after the other), G = 8; W from the episodes' finish times.

Where the workers' time goes: before Ray starts, one worker alone runs 30 episodes without
latency (``--solo-episodes``): a turn's generation cost with a core to itself. Each run's
table then gives, per turn, the generation wall-clock, the CPU time of the workers' episode
threads and the time those threads waited, runnable, for a core (``worker_timing``,
trajgrad.train.workers), and each SAO / grouped ratio is printed next to what the barrier
alone gives with the generation times measured (:func:`barrier_ratio`).

Part 2, reward curves at equal wall-clock on the tiny presets: ``sao-tiny`` (2 workers)
against ``tiny`` (GRPO, in-process), both starting from the same SFT warm start (done once),
no environment latency; written with trajgrad.view.plot.plot_compare.

    .venv/bin/python bench/bench_async.py                      # both parts
    .venv/bin/python bench/bench_async.py --skip-curves --seconds 30 --latency 0.05,1.0 0.5,1.0

Writes bench/results/async.md and bench/results/sao_vs_grpo.png.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent


def _throughput_config(kind: str, workers: int, mu: float, sigma: float, seed: int):
    from trajgrad.train.config import build_config

    data = {
        "name": f"bench-{kind}",
        "model": {"name": "tiny", "dtype": "float32", "lora": None,
                  "tiny": {"hidden_size": 96, "layers": 2, "heads": 4}},
        "task": {"name": "calculator", "n_train": 4000, "n_heldout": 8,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 3,
                             "min_ops": 1, "max_ops": 2, "max_operand": 99}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 24},
        "optim": {"lr": 3e-4},
        "train": {"steps": 100000, "micro_batch_size": 64, "seed": seed},
        "sft": {"steps": 0},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": True},
        "asynchronous": {"enabled": kind.startswith("sao"), "workers": workers, "max_lag": 2,
                         "batch_trajectories": 8, "queue_size": 2 * workers if kind == "sao" else workers,
                         "partial": "per_segment", "env_latency": {"mu": mu, "sigma": sigma}},
    }
    if kind.startswith("sao"):
        data["recipe"] = {"name": "sao"}
        data["critic"] = {"warmup_steps": 0}
    else:
        data["recipe"] = {"name": "grpo", "overrides": {"kl_coef": 0.0, "kl_placement": "none"}}
        data["train"].update({"prompts_per_step": 1, "group_size": 8})
    return build_config(data)


def _worker_time(run_dir, workers: int, seconds: float, extra=()) -> dict:
    """Where the rollout workers' time went, from the logged trajectories (every finished
    sub-trace, trained or dropped): ``busy`` = sum over episodes of (generation + environment
    time) / (workers x seconds); ``gen_share`` = generation / (generation + environment);
    mean seconds per turn of each (wall-clock). From each episode's ``worker_timing``
    (trajgrad.train.workers.episode_timing): the episode thread's CPU seconds per turn
    (``cpu_per_turn``: generation is nearly all of it), the seconds per turn it was runnable
    but waited for a CPU (``wait_per_turn``), and the cores the workers used (process CPU,
    Ray's threads included, over the wall-clock)."""
    from trajgrad.rollout import read_trajectories

    path = Path(run_dir) / "trajectories.jsonl"
    trajs = (read_trajectories(path) if path.exists() else []) + list(extra)
    gen = sum(u.gen_seconds for t in trajs for u in t.turns)
    env = sum(u.env_seconds for t in trajs for u in t.turns)
    turns = sum(len(t.turns) for t in trajs)
    timed = [t.metadata["worker_timing"] for t in trajs if "worker_timing" in t.metadata]
    timed_ids = {t.episode_id for t in trajs if "worker_timing" in t.metadata}
    timed_turns = sum(len(t.turns) for t in trajs if t.episode_id in timed_ids)
    waits = [w["runqueue_seconds"] for w in timed if w.get("runqueue_seconds") is not None]
    nan = float("nan")
    return {"busy": (gen + env) / max(workers * seconds, 1e-9), "gen_share": gen / max(gen + env, 1e-9),
            "gen_per_turn": gen / max(turns, 1), "env_per_turn": env / max(turns, 1),
            "turns_per_episode": turns / max(len({t.episode_id for t in trajs}), 1),
            "cpu_per_turn": sum(w["thread_cpu_seconds"] for w in timed) / timed_turns if timed_turns else nan,
            "wait_per_turn": sum(waits) / timed_turns if timed_turns and len(waits) == len(timed) else nan,
            "worker_cores": sum(w["process_cpu_seconds"] for w in timed) / max(seconds, 1e-9) if timed else nan}


def barrier_ratio(mu: float, sigma: float, turns: int, g_single: float, g_grouped: float, G: int = 8,
                  n: int = 100_000, seed: int = 0) -> float:
    r"""The throughput ratio the group barrier alone gives, single rollouts over groups of G.

    An episode of ``turns`` turns takes :math:`T = \sum_{t} (g + e^{Z_t})`, :math:`Z_t \sim
    N(\mu, \sigma^2)`, with ``g`` the generation seconds per turn measured for each method
    (``g_single`` for SAO, ``g_grouped`` for grouped GRPO). A worker running single rollouts
    back to back finishes one every :math:`E[T]`; a group of G on G workers every
    :math:`E[\max_i T_i]`. The ratio is :math:`E[\max_{i \le G} T_i(g_{grouped})] / E[T(g_{single})]`
    (n simulated groups): no Ray, learner or update time. With ``g`` = 0 it is the most that
    removing the barrier gives; the grouped loop's updates and dispatch, during which its
    workers idle, come on top (a measured ratio above it), CPU contention under the larger
    throughput of single rollouts below it.
    """
    rng = np.random.default_rng(seed)
    lat = np.exp(rng.normal(mu, sigma, size=(n, G, turns))).sum(-1)
    return float((lat.max(1) + turns * g_grouped).mean() / (lat.mean() + turns * g_single))


def _rows(run_dir):
    from trajgrad.train.metrics import read_metrics

    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


def solo_generation(episodes: int, seed: int) -> dict:
    """One rollout worker alone, in this process, before Ray starts: the same model, task
    and sampling as the throughput runs, no environment latency. Its generation seconds per
    turn are what a turn costs when it has a core to itself (the ``g`` of an idle machine)."""
    from trajgrad.train.workers import RolloutWorker

    cfg = _throughput_config("sao", 1, 0.0, 0.0, seed)
    data = cfg.model_dump()
    data["asynchronous"]["env_latency"] = None
    w = RolloutWorker(data, 0, None, torch_threads=1)
    tasks = w.source.tasks("train", episodes + 3, seed)
    for k in range(3):  # warm-up
        w.episode(f"w{k}", tasks[k], k)
    trajs = [t for k in range(3, episodes + 3) for t in w.episode(f"s{k}", tasks[k], k)["trajectories"]]
    turns = [u for t in trajs for u in t.turns]
    timed = [t.metadata["worker_timing"] for t in trajs if "worker_timing" in t.metadata]
    return {"episodes": episodes, "turns": len(turns), "tokens_per_turn": sum(len(u.action_ids) for u in turns) / len(turns),
            "gen_per_turn": sum(u.gen_seconds for u in turns) / len(turns),
            "cpu_per_turn": sum(x["thread_cpu_seconds"] for x in timed) / len(turns)}


def run_sao(kind, workers, mu, sigma, seconds, seed, root):
    from trajgrad.train.asynchronous import AsyncTrainer

    cfg = _throughput_config(kind, workers, mu, sigma, seed)
    at = AsyncTrainer(cfg, root, console=lambda *a: None)
    s = at.run(max_seconds=seconds)
    rows = _rows(root)
    # finished episodes still waiting in the gate at the end (not logged yet)
    waiting = [t for item in at.gate.pending for t in item.payload[0]]
    n = np.array([r["batch/trajectories"] for r in rows])
    lag = np.array([r["lag/mean"] for r in rows])
    return {
        "variant": kind, "workers": workers, "in_flight": cfg.asynchronous.queue_size, "seconds": s["seconds"],
        "updates": s["steps"], "trajectories": s["episodes_finished"], "traj_per_s": s["trajectories_per_s"],
        "trained_per_s": s["trajectories_trained"] / s["seconds"],
        "lag_mean": float((n * lag).sum() / max(n.sum(), 1)), "lag_max": max((r["lag/max"] for r in rows), default=0),
        "dropped_lag": s["dropped_lag"], "W_per_rollout": 0.0, "W_per_update": 0.0,
        "idle_frac": float(np.mean([r["time/learner_idle_frac"] for r in rows])) if rows else float("nan"),
        **_worker_time(root, workers, s["seconds"], waiting),
    }


def run_grpo_ray(workers, mu, sigma, seconds, seed, root):
    from trajgrad.train.asynchronous import GroupedRayTrainer

    cfg = _throughput_config("grpo-ray", workers, mu, sigma, seed)
    gt = GroupedRayTrainer(cfg, root, console=lambda *a: None)
    s = gt.run(max_seconds=seconds)
    rows = _rows(root)
    return {
        "variant": "grpo-ray", "workers": workers, "in_flight": 8, "seconds": s["seconds"], "updates": s["steps"],
        "trajectories": s["episodes_finished"], "traj_per_s": s["trajectories_per_s"],
        "trained_per_s": s["trajectories_per_s"], "lag_mean": 0.0,
        "lag_max": max((r["lag/max"] for r in rows), default=0), "dropped_lag": 0,
        "W_per_rollout": s["group_wait_W_per_rollout"],
        "W_per_update": float(np.mean([r["group/wait_W"] for r in rows])) if rows else float("nan"),
        "idle_frac": float(np.mean([r["time/learner_idle_frac"] for r in rows])) if rows else float("nan"),
        **_worker_time(root, workers, s["seconds"]),
    }


def run_grpo_local(mu, sigma, seconds, seed, root):
    """The existing synchronous Trainer loop with the same latency environment."""
    from tqdm.auto import tqdm

    from trajgrad.envs.latency import with_latency
    from trajgrad.train.asynchronous import group_wait
    from trajgrad.train.trainer import Trainer

    cfg = _throughput_config("grpo-local", 1, mu, sigma, seed)
    tr = Trainer(cfg, root, console=lambda *a: None)
    tr.source = with_latency(tr.source, {"mu": mu, "sigma": sigma}, seed=seed)
    n_traj, W, t0 = 0, [], time.perf_counter()
    log_offset = tr.traj_log.offset
    bar = tqdm(desc="grpo in-process", unit="update")
    while time.perf_counter() - t0 < seconds:
        m = tr.train_step()
        tr.step += 1
        tr.metrics.log(tr.step, m, kind="train")
        bar.update(1)
    bar.close()
    dt = time.perf_counter() - t0
    tr.traj_log.close()
    from trajgrad.rollout import read_trajectories

    trajs = read_trajectories(root / "trajectories.jsonl", start=log_offset)
    groups = {}
    for t in trajs:
        groups.setdefault(t.task_id, []).append(t.created_at)  # created when its last env step returned
    W = [group_wait(v) for v in groups.values()]
    n_traj = len(trajs)
    return {
        "variant": "grpo-local", "workers": 1, "in_flight": 8, "seconds": dt, "updates": tr.step,
        "trajectories": n_traj, "traj_per_s": n_traj / dt, "trained_per_s": n_traj / dt, "lag_mean": 0.0,
        "lag_max": 0, "dropped_lag": 0, "W_per_rollout": float(sum(W) / max(n_traj, 1)),
        "W_per_update": float(np.mean(W)) if W else float("nan"), "idle_frac": float("nan"),
        **_worker_time(root, 1, dt),
    }


# ---------------------------------------------------------------------------- part 2
def reward_curves(seconds, root, out_png, sft_steps=None):
    from tqdm.auto import tqdm

    from trajgrad.train.asynchronous import AsyncTrainer
    from trajgrad.train.config import load_config
    from trajgrad.view.plot import plot_compare
    from trajgrad.train.trainer import Trainer

    common = {"eval.before": False, "eval.after": True, "eval.every": 0, "checkpoint.every": 0,
              "log.tensorboard": False, "train.steps": 100000}
    # the presets' SFT warm start, done once and shared (both presets use the same model,
    # seed and SFT settings)
    sft_over = {**common, "eval.after": False}
    if sft_steps is not None:
        sft_over["sft.steps"] = sft_steps
    sft_cfg = load_config(preset="tiny", overrides=sft_over)
    sft_tr = Trainer(sft_cfg, root / "sft", console=lambda *a: None)
    bar = tqdm(total=sft_cfg.sft.steps, desc="shared SFT warm start")
    t_sft = time.perf_counter()
    sft_tr.sft(sft_cfg.sft.steps, sft_cfg.sft.batch_size, sft_cfg.sft.lr, progress=lambda s, l: bar.update(1))
    bar.close()
    t_sft = time.perf_counter() - t_sft
    state = copy.deepcopy(sft_tr.model.state_dict())

    over = {**common, "sft.steps": 0}
    # SAO first: its wall-clock (logger time, Ray start-up and actor boot included) sets the
    # budget GRPO gets on the same axis
    s_cfg = load_config(preset="sao-tiny", overrides=over)
    at = AsyncTrainer(s_cfg, root / "sao", console=lambda *a: None)
    at.trainer.model.load_state_dict(state)
    s_sum = at.run(max_seconds=seconds)
    sao_wall = max(r["wall_time"] for r in _rows(root / "sao"))

    g_cfg = load_config(preset="tiny", overrides=over)
    g = Trainer(g_cfg, root / "grpo", console=lambda *a: None)
    g.model.load_state_dict(state)
    bar = tqdm(desc="grpo (tiny preset)", unit="update")
    while g.metrics.wall_time < sao_wall:
        m = g.train_step()
        g.step += 1
        g.metrics.log(g.step, m, kind="train")
        bar.update(1)
    bar.close()
    g_after = g.evaluate("after")

    from trajgrad.objective import get_recipe

    G = g_cfg.train.group_size or get_recipe(g_cfg.recipe.name).group_size
    grpo_batch = f"{g_cfg.train.prompts_per_step} prompts x G = {G}"
    sao_batch = f"{s_cfg.asynchronous.batch_trajectories} trajectories"
    plot_compare({f"SAO (sao-tiny: async, {s_cfg.asynchronous.workers} Ray workers)": root / "sao",
                  f"GRPO (tiny: in-process, {grpo_batch})": root / "grpo"},
                 "reward/mean", out_png, x="wall_time", smoothing=0.6,
                 title=f"training reward at equal wall-clock ({sao_wall:.0f} s each, same SFT start)")

    def summary(rows):
        last = rows[-5:]
        return {"updates": len(rows), "trajectories": int(sum(r.get("batch/trajectories", 64) for r in rows)),
                "reward_first5": float(np.mean([r["reward/mean"] for r in rows[:5]])),
                "reward_last5": float(np.mean([r["reward/mean"] for r in last])),
                "wall": rows[-1]["wall_time"] if rows else float("nan")}

    gs = summary(_rows(root / "grpo"))
    gs["trajectories"] = int(sum(1 for _ in open(root / "grpo" / "trajectories.jsonl")))
    ss = summary(_rows(root / "sao"))
    ss["trajectories"] = s_sum["trajectories_trained"]
    return {"sft_seconds": t_sft, "sft_steps": sft_cfg.sft.steps, "wall": sao_wall, "grpo_batch": grpo_batch,
            "sao_batch": sao_batch, "sao_workers": s_cfg.asynchronous.workers, "sao_max_lag": s_cfg.asynchronous.max_lag,
            "grpo": {**gs, "heldout": g_after.__dict__},
            "sao": {**ss, "heldout": s_sum.get("eval_after", {})}}


# ---------------------------------------------------------------------------- report
def _machine_load() -> str:
    try:
        la = os.getloadavg()
        return f"{la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f}"
    except OSError:  # pragma: no cover
        return "load average unavailable"


def _memory_gib() -> float:
    """Physical memory of this machine in GiB (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return 0.0


def write_report(path, args, rows, curves, loads, cmd, solo=None):
    import ray
    import torch

    lines = [
        "# SAO (asynchronous, single rollout) vs synchronous grouped GRPO",
        "",
        f"Date: {datetime.date.today().isoformat()}. torch {torch.__version__}, ray {ray.__version__}, "
        f"Python {sys.version.split()[0]}. Command:",
        "",
        "```",
        cmd,
        "```",
        "",
        f"Machine: {os.cpu_count()} CPU cores and {_memory_gib():.0f} GiB. Load average (1/5/15 min) while running, "
        "which the benchmark's own workers and learner raise; a figure above the core count at the start means "
        "other work shared the machine: " + "; ".join(loads) + ".",
        "",
        "## Throughput under heavy-tailed environment latency",
        "",
        "Every `env.step` sleeps `exp(Z)`, `Z ~ N(mu, sigma^2)` (log-seconds). Tiny random model (hidden 96, "
        "2 layers), calculator task, 3 turns per episode (the untrained model never answers), at most 24 new tokens "
        f"per turn. Each variant trains for {args.seconds:.0f} s of wall-clock after start-up (the last update may "
        f"end a little later; rates use the measured time). N = {args.workers} Ray workers for the Ray variants, each "
        "executing at most one episode at a time; `episodes in flight` is the number submitted and not finished "
        "(SAO: `asynchronous.queue_size`; a second episode queued on an actor starts when the first ends).",
    ]
    if solo is not None:
        lines += ["", f"One worker alone (in the benchmark's process before Ray starts, no latency, {solo['episodes']} "
                      f"episodes, {solo['tokens_per_turn']:.1f} tokens per turn): **{solo['gen_per_turn']:.3f} s of "
                      f"generation per turn** ({solo['cpu_per_turn']:.3f} s CPU): the cost of a turn with a core to "
                      "itself, against the `generation s/turn` of the runs below."]
    header = [
        "",
        "| variant | workers | episodes in flight | updates | trajectories | trajectories/s | trained/s | mean lag | "
        "max lag | dropped (lag) | W per rollout (s) | W per update (s) | learner idle | worker busy | "
        "generation share | generation s/turn | env s/turn | worker CPU s/turn | CPU wait s/turn | worker cores |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    settings = []
    for r in rows:
        if (r["mu"], r["sigma"]) not in settings:
            settings.append((r["mu"], r["sigma"]))
    for mu, sigma in settings:
        sub = [r for r in rows if (r["mu"], r["sigma"]) == (mu, sigma)]
        lines += ["", f"### mu = {mu:.4f} = log({math.exp(mu):.3g} s), sigma = {sigma}: median "
                      f"{math.exp(mu) * 1000:.0f} ms, mean {math.exp(mu + sigma ** 2 / 2) * 1000:.0f} ms per step; "
                      f"{sub[0].get('budget', args.seconds):.0f} s per variant"]
        lines += header
        for r in sub:
            idle = "n/a" if math.isnan(r["idle_frac"]) else f"{r['idle_frac']:.0%}"
            lines.append(
                f"| {r['variant']} | {r['workers']} | {r['in_flight']} | {r['updates']} | {r['trajectories']} | "
                f"{r['traj_per_s']:.2f} | {r['trained_per_s']:.2f} | {r['lag_mean']:.2f} | {r['lag_max']:.0f} | "
                f"{r['dropped_lag']} | {r['W_per_rollout']:.3f} | {r['W_per_update']:.3f} | {idle} | "
                f"{r.get('busy', float('nan')):.0%} | {r.get('gen_share', float('nan')):.0%} | "
                f"{r.get('gen_per_turn', float('nan')):.3f} | {r.get('env_per_turn', float('nan')):.3f} | "
                f"{r.get('cpu_per_turn', float('nan')):.3f} | {r.get('wait_per_turn', float('nan')):.3f} | "
                f"{r.get('worker_cores', float('nan')):.2f} |")
        by = {r["variant"]: r for r in sub}
        if "sao" in by and "grpo-ray" in by:
            ratio = by["sao"]["traj_per_s"] / max(by["grpo-ray"]["traj_per_s"], 1e-9)
            ok = ratio >= 2.0 and by["sao"]["lag_mean"] <= 2.0
            turns = max(1, round(by["sao"].get("turns_per_episode", 3)))
            bound = barrier_ratio(mu, sigma, turns, by["sao"]["gen_per_turn"], by["grpo-ray"]["gen_per_turn"])
            bound0 = barrier_ratio(mu, sigma, turns, 0.0, 0.0)
            lines += ["", f"SAO / grouped GRPO on the same Ray workers: **{ratio:.2f}x** trajectories per second at "
                          f"mean policy lag {by['sao']['lag_mean']:.2f} versions. Target (>= 2x at mean lag <= 2): "
                          f"**{'met' if ok else 'missed'}**. The barrier alone (`barrier_ratio`, {turns} turns, simulated "
                          f"with the generation seconds per turn measured here, {by['sao']['gen_per_turn']:.3f} SAO and "
                          f"{by['grpo-ray']['gen_per_turn']:.3f} grouped) gives {bound:.2f}x; with free generation "
                          f"{bound0:.2f}x."]
        if "sao" in by and "grpo-local" in by:
            ratio = by["sao"]["traj_per_s"] / max(by["grpo-local"]["traj_per_s"], 1e-9)
            lines += ["", f"SAO / the in-process synchronous Trainer loop: {ratio:.2f}x trajectories per second."]
    lines += [
        "",
        "W is §20.1's within-group wait, sum_i (T_ready - T_i) per group of G = 8, with T_i the time rollout i reached "
        "the learner (grpo-ray) or the time its last environment step returned (grpo-local, whose sampler steps the "
        "environments of a batch one after the other). `trajectories` counts finished sub-traces (SAO: including the "
        "ones later dropped for lag); `trained/s` only those that reached an update; `learner idle` is the fraction "
        "of the loop the learner spent waiting for rollouts. `worker busy` is the workers' generation plus "
        "environment time over workers x wall-clock (what is missing: Ray calls, weight loading, episodes still in "
        "flight at the end, and for grouped GRPO the barrier and the update, during which workers wait); "
        "`generation share` is generation / (generation + environment): near 100% the setting is bound by the "
        "CPU, not by the latency. `worker CPU s/turn` is the CPU time of a worker's episode thread per turn "
        "(generation nearly all of it), `CPU wait s/turn` the time per turn that thread was runnable but waited for "
        "a core (Linux schedstat): generation wall-clock is about their sum, so a wait far above the CPU time means "
        "the cores are oversubscribed. `worker cores`: the workers' process CPU time over the wall-clock.",
    ]
    if curves is not None:
        g, s = curves["grpo"], curves["sao"]
        lines += [
            "",
            "## Reward at equal wall-clock on the tiny presets",
            "",
            f"Both runs start from the same SFT warm start ({curves['sft_steps']} steps as in the presets, run once: "
            f"{curves['sft_seconds']:.0f} s), "
            f"then train for the same wall-clock, {curves['wall']:.0f} s each on the metrics clock (SAO: "
            f"{args.curve_seconds:.0f} s of training loop plus Ray start-up and actor boot), no environment latency: "
            f"`tiny` (GRPO, in-process sampler, {curves['grpo_batch']} per update) and `sao-tiny` (SAO, "
            f"{curves['sao_workers']} Ray workers, {curves['sao_batch']} per update, max lag {curves['sao_max_lag']}). Curve: "
            "[sao_vs_grpo.png](sao_vs_grpo.png) (training reward/mean vs wall-clock, EMA 0.6).",
            "",
            "| run | updates | trajectories trained | reward (first 5 updates) | reward (last 5 updates) | held-out success after |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, d in (("GRPO (tiny)", g), ("SAO (sao-tiny)", s)):
            h = d.get("heldout") or {}
            succ = f"{h.get('successes', 0)}/{h.get('n', 0)}" if h else "n/a"
            lines.append(f"| {name} | {d['updates']} | {d['trajectories']} | {d['reward_first5']:.3f} | "
                         f"{d['reward_last5']:.3f} | {succ} |")
    if args.notes:
        lines += ["", "## Notes", "", Path(args.notes).read_text().strip()]
    Path(path).write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget of each throughput variant")
    p.add_argument("--latency", nargs="+", default=["0.05,1.0"],
                   help="one or more MEDIAN_SECONDS,SIGMA[,BUDGET_SECONDS] settings: mu = log(MEDIAN_SECONDS), sigma in "
                   "log-seconds, each variant trained for BUDGET_SECONDS (default --seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="sao,sao-q1,grpo-ray,grpo-local")
    p.add_argument("--skip-curves", action="store_true")
    p.add_argument("--curve-seconds", type=float, default=120.0)
    p.add_argument("--sft-steps", type=int, default=None, help="override the presets' SFT steps (quick checks)")
    p.add_argument("--notes", default=None, help="a text file appended to the report")
    p.add_argument("--solo-episodes", type=int, default=30,
                   help="episodes of one worker alone (no latency, before Ray starts) for the idle-machine cost of a "
                   "turn; 0 skips it")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    settings = []
    for item in args.latency:
        vals = [float(x) for x in item.split(",")]
        med, sig = vals[0], vals[1]
        settings.append((math.log(med), sig, vals[2] if len(vals) > 2 else args.seconds))

    import ray
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_async_"))
    loads = [f"start {_machine_load()}"]
    solo = solo_generation(args.solo_episodes, args.seed) if args.solo_episodes > 0 else None
    if solo is not None:
        print(json.dumps({"solo": solo}), flush=True)
    ray.init(num_cpus=max(args.workers + 1, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    rows = []
    curves = None
    try:
        for k, (mu, sigma, seconds) in enumerate(settings):
            for v in [x.strip() for x in args.variants.split(",") if x.strip()]:
                print(f"== {v}, mu={mu:.4f}, sigma={sigma}", flush=True)
                d = root / f"{k}-{v}"
                if v in ("sao", "sao-q1"):
                    r = run_sao(v, args.workers, mu, sigma, seconds, args.seed, d)
                elif v == "grpo-ray":
                    r = run_grpo_ray(args.workers, mu, sigma, seconds, args.seed, d)
                elif v == "grpo-local":
                    r = run_grpo_local(mu, sigma, seconds, args.seed, d)
                else:
                    raise SystemExit(f"--variants: unknown {v!r}")
                r.update(mu=mu, sigma=sigma, budget=seconds)
                rows.append(r)
                print(json.dumps(r), flush=True)
                loads.append(f"after {v} ({math.exp(mu):.3g} s) {_machine_load()}")
        if not args.skip_curves:
            print("== reward curves", flush=True)
            curves = reward_curves(args.curve_seconds, root, out / "sao_vs_grpo.png", sft_steps=args.sft_steps)
            print(json.dumps(curves, default=str), flush=True)
            loads.append(f"after curves {_machine_load()}")
    finally:
        ray.shutdown()
    cmd = ".venv/bin/python bench/bench_async.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(out / "async.md", args, rows, curves, loads, cmd.strip(), solo)
    print(f"wrote {out / 'async.md'}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
