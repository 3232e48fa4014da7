"""Single-rollout asynchronous optimization on Ray (§20) with partial rollouts (§16).

Pure parts first (group wait, the lag gate, weight sync tensors, environment latency),
then one module-scoped Ray session: an asynchronous SAO run on the guess environment with
compaction (§19) during which a rollout actor is killed mid-episode, its resumption, and
a short grouped (synchronous GRPO) baseline run."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.advantages import returns
from trajgrad.envs.base import StepResult, Task
from trajgrad.envs.latency import LatencyEnv, LatencyTaskSource, lognormal_mean, with_latency
from trajgrad.rollout import read_trajectories
from trajgrad.model.tiny import build_tiny_model
from trajgrad.model.tokenizer import build_char_tokenizer
from trajgrad.train.asynchronous import (
    SAO_PRESETS,
    AsyncTrainer,
    GroupedRayTrainer,
    LagGate,
    group_wait,
    lag_histogram,
    load_trainable_state,
    trainable_state,
)
from trajgrad.train import updates
from trajgrad.train.async_state import load_async_state
from trajgrad.train.checkpoint import latest_checkpoint
from trajgrad.train.config import PRESETS, build_config, load_config
from trajgrad.train.metrics import read_metrics


# ============================================================================ group wait
def test_group_wait_worked_numbers():
    # T = (1, 3, 2): T_ready = 3, W = (3-1) + (3-3) + (3-2) = 3
    assert group_wait([1.0, 3.0, 2.0]) == 3.0
    assert group_wait([5.0]) == 0.0
    # G = 4 equal durations: no wait
    assert group_wait([2.5] * 4) == 0.0
    # one straggler: W = 3 * (10 - 1)
    assert group_wait([1.0, 1.0, 1.0, 10.0]) == 27.0


def test_group_wait_bad_input():
    with pytest.raises(ValueError, match="finish_times"):
        group_wait([])
    with pytest.raises(ValueError, match="finish_times"):
        group_wait([1.0, float("nan")])
    with pytest.raises(ValueError, match="finish_times"):
        group_wait(["a"])


def test_lag_histogram():
    h = lag_histogram([0, 1, 1, 2, 5], max_lag=2)
    assert h == {"lag/hist_0": 1, "lag/hist_1": 2, "lag/hist_2": 1, "lag/hist_over": 1}
    with pytest.raises(ValueError, match="lags"):
        lag_histogram([-1], 2)


# ============================================================================ the lag gate
def test_lag_gate_batches_fifo_and_drops_stale():
    g = LagGate(batch_trajectories=3, max_lag=1)
    assert g.admit("a", 0, size=2) and g.admit("b", 0, size=1)
    assert not g.admit("a", 0)  # trained at most once: a key is accepted once
    assert g.duplicates == 1
    batch = g.next_batch(1)  # lags 1, 1: fine
    assert [x.key for x in batch] == ["a", "b"]
    g.admit("c", 0, size=3)
    g.admit("d", 2, size=1)
    assert g.next_batch(2) is None  # "c" has lag 2 > 1: dropped; "d" alone is 1 < 3
    assert [x.key for x in g.last_dropped] == ["c"]
    assert g.dropped_lag == 1 and g.dropped_lag_trajectories == 3
    g.admit("e", 2, size=1)
    g.admit("f", 2, size=2)  # whole episodes: 1 + 1 + 2 = 4 >= 3
    assert [x.key for x in g.next_batch(2)] == ["d", "e", "f"]
    assert g.admitted == 6 and g.trained == 5 and g.trained_trajectories == 7
    with pytest.raises(ValueError, match="learner_version"):
        g.admit("z", 9)
        g.next_batch(3)


def test_lag_gate_bad_input():
    with pytest.raises(ValueError, match="batch_trajectories"):
        LagGate(0, 1)
    with pytest.raises(ValueError, match="max_lag"):
        LagGate(1, -1)
    g = LagGate(1, 0)
    with pytest.raises(ValueError, match="key"):
        g.admit("", 0)
    with pytest.raises(ValueError, match="oldest_version"):
        g.admit("a", -1)
    with pytest.raises(ValueError, match="size"):
        g.admit("a", 0, size=0)
    with pytest.raises(ValueError, match="learner_version"):
        g.next_batch(-2)


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3), st.booleans(), st.booleans()), max_size=60),
    max_lag=st.integers(0, 3),
    batch=st.integers(1, 5),
)
def test_policy_lag_never_exceeds_bound(schedule, max_lag, batch):
    """Random completion schedules: an episode finishes having been started ``back``
    updates ago (its oldest version), possibly re-delivered; the learner asks for a batch
    after every completion and updates when it gets one. Every trained episode has lag
    in [0, max_lag], none is trained twice, and nothing is lost from the accounting."""
    g = LagGate(batch, max_lag)
    v = 0
    trained = []
    keys = []
    for i, (back, size, redeliver, skip_update) in enumerate(schedule):
        key = keys[-1] if (redeliver and keys) else f"e{i}"
        if key == f"e{i}":
            keys.append(key)
        g.admit(key, max(0, v - back), size=size)
        if skip_update:
            continue
        got = g.next_batch(v)
        for item in g.last_dropped:
            assert v - item.oldest_version > max_lag
        if got is not None:
            n = sum(x.size for x in got)
            assert batch <= n < batch + 3
            for item in got:
                assert 0 <= v - item.oldest_version <= max_lag
                trained.append(item.key)
            v += 1
    assert len(trained) == len(set(trained))
    assert g.admitted == len(keys) == g.trained + g.dropped_lag + len(g.pending)
    assert g.duplicates == len(schedule) - len(keys)


# ============================================================================ weights
def test_trainable_state_roundtrip():
    tok = build_char_tokenizer()
    a = build_tiny_model(tok, hidden_size=16, layers=1, heads=2, seed=0)
    b = build_tiny_model(tok, hidden_size=16, layers=1, heads=2, seed=1)
    state = trainable_state(a)
    assert set(state) == {n for n, p in a.named_parameters() if p.requires_grad}
    assert load_trainable_state(b, state) == len(state)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    # only trainable tensors travel: frozen ones are left alone
    for p in b.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="model"):
        trainable_state(b)
    name = next(iter(state))
    with pytest.raises(ValueError, match="state"):
        load_trainable_state(a, {"nope": state[name]})
    with pytest.raises(ValueError, match="state"):
        load_trainable_state(a, {name: torch.zeros(3, 3, 3)})


# ============================================================================ latency
class _Env:
    name = "e"
    max_turns = 2

    def reset(self, task):
        return [{"role": "user", "content": "q"}]

    def step(self, text):
        return StepResult([], 1.0, True, False, {"success": True})

    def potential(self):
        return 0.5


class _Source:
    name = "src"

    def tasks(self, split, n, seed):
        return [Task(id=f"x{i}", split=split, prompt="q", answer=i) for i in range(n)]

    def make_env(self, **kw):
        return _Env()

    def demonstration(self, task):
        return []


def test_latency_env_draws_lognormal_and_forwards():
    mu, sigma = math.log(2e-4), 0.5
    e = LatencyEnv(_Env(), mu, sigma, seed=7)
    assert e.name == "e" and e.max_turns == 2 and e.potential() == 0.5
    e.reset(Task(id="x", split="train", prompt="q", answer=0))
    t0 = time.perf_counter()
    res = e.step("a")
    elapsed = time.perf_counter() - t0
    assert res.reward == 1.0 and res.terminated and res.info["success"]
    # the slept time is exp(Z), Z ~ N(mu, sigma) from the seeded stream
    import random

    z = random.Random(7).gauss(mu, sigma)
    assert res.info["latency_seconds"] == pytest.approx(math.exp(z))
    assert elapsed >= math.exp(z)
    # sigma = 0: a constant exp(mu)
    assert LatencyEnv(_Env(), mu, 0.0).draw() == pytest.approx(2e-4)
    # log-normal mean e^{mu + sigma^2/2}
    assert lognormal_mean(math.log(0.05), 1.0) == pytest.approx(0.05 * math.exp(0.5))


def test_latency_source_seeds_and_spec():
    src = with_latency(_Source(), {"mu": math.log(1e-4), "sigma": 1.0, "seed": 3.0})
    assert isinstance(src, LatencyTaskSource) and src.seed == 3 and src.name == "src"
    e1, e2 = src.make_env(), src.make_env()
    again = LatencyTaskSource(_Source(), math.log(1e-4), 1.0, seed=3)
    f1, f2 = again.make_env(), again.make_env()
    assert [e1.draw(), e2.draw()] == [f1.draw(), f2.draw()]
    assert e1.seed != e2.seed
    assert len(src.tasks("train", 2, 0)) == 2
    assert with_latency(_Source(), None).__class__ is _Source


@pytest.mark.parametrize("kw,arg", [
    (dict(mu=float("nan"), sigma=1.0), "mu"), (dict(mu=0.0, sigma=-1.0), "sigma"), (dict(mu=100.0, sigma=0.0), "mu"),
    (dict(mu=0.0, sigma="x"), "sigma"), (dict(mu=0.0, sigma=0.0, seed=1.5), "seed"),
])
def test_latency_bad_input(kw, arg):
    with pytest.raises(ValueError, match=arg):
        LatencyEnv(_Env(), **kw)
    with pytest.raises(ValueError, match=arg):
        LatencyTaskSource(_Source(), **kw)


def test_latency_spec_bad_input():
    with pytest.raises(ValueError, match="env"):
        LatencyEnv(object(), 0.0, 0.0)
    with pytest.raises(ValueError, match="source"):
        LatencyTaskSource(object(), 0.0, 0.0)
    with pytest.raises(ValueError, match="spec"):
        with_latency(_Source(), {"mu": 0.0})
    with pytest.raises(ValueError, match="spec"):
        with_latency(_Source(), {"mu": 0.0, "sigma": 1.0, "scale": 2})
    with pytest.raises(ValueError, match="spec"):
        with_latency(_Source(), [0.0, 1.0])


# ============================================================================ presets / config
def test_sao_presets_registered_and_valid():
    for name in ("sao-tiny", "sao", "sao-coding"):
        assert name in PRESETS
        cfg = load_config(preset=name)
        assert cfg.asynchronous.enabled and cfg.recipe.name == "sao"
        obj = cfg.objective()
        assert obj.group_size == 1 and obj.critic and obj.critic_updates == 2
    assert (load_config(preset="sao").objective().eps_low, load_config(preset="sao").objective().eps_high) == (0.3, 5.0)
    coding = load_config(preset="sao-coding").objective()
    assert (coding.eps_low, coding.eps_high) == (0.8, 3.0)
    assert load_config(preset="sao-tiny").model.name == "tiny"
    assert set(SAO_PRESETS) == {"sao-tiny", "sao", "sao-coding"}


def _config(steps: int, *, recipe: str = "sao", **over):
    data = {
        "name": "async-test",
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        # three guesses; compaction after the second: every episode has two sub-traces (§19)
        "task": {"name": "guess", "n_train": 64, "n_heldout": 4,
                 "options": {"upper": 8, "max_turns": 3, "compact_every": 2, "few_shot": False, "turn_cost": 0.1}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "recipe": {"name": recipe},
        "train": {"steps": steps, "prompts_per_step": 1, "micro_batch_size": 4},
        "critic": {"warmup_steps": 0},
        "sft": {"steps": 0},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 1},
        "log": {"tensorboard": False, "progress": False},
        # constant 0.12 s per env step: an episode takes a few tenths of a second
        "asynchronous": {"enabled": True, "workers": 2, "max_lag": 1, "batch_trajectories": 4, "queue_size": 4,
                         "partial": "per_segment", "env_latency": {"mu": math.log(0.12), "sigma": 0.0}},
    }
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v}
    return build_config(data)


def test_thread_schedstat_reads_this_threads_cpu_time():
    from trajgrad.train.workers import thread_schedstat

    first = thread_schedstat()
    if first is None:
        pytest.skip("no /proc/thread-self/schedstat on this system")
    x = 0
    for i in range(200_000):  # some CPU time of this thread
        x += i
    cpu, wait = thread_schedstat()
    thread = time.thread_time()
    assert cpu > first[0] and wait >= first[1] >= 0
    # the first field is the kernel's CPU time of this thread, the clock thread_time() reads
    assert abs(cpu - thread) < 0.05


def test_worker_records_where_its_episode_time_went():
    """Every episode's first sub-trace carries the worker's timing: CPU time never exceeds
    the wall-clock minus the environment's sleeps (a sleeping thread uses none)."""
    from trajgrad.train.workers import RolloutWorker

    cfg = _config(1)
    w = RolloutWorker(cfg.model_dump(), 0, None, torch_threads=1)
    task = w.source.tasks("train", 1, 0)[0]
    res = w.episode("k0", task, 0)
    trajs = res["trajectories"]
    assert len(trajs) == 2  # compaction after the second guess: two sub-traces
    assert "worker_timing" in trajs[0].metadata and "worker_timing" not in trajs[1].metadata
    tm = trajs[0].metadata["worker_timing"]
    turns = [u for t in trajs for u in t.turns]
    slept = sum(u.info["latency_seconds"] for u in turns)
    assert slept >= 0.12 * len(turns) - 1e-6
    assert tm["seconds"] == res["seconds"] >= sum(u.gen_seconds + u.env_seconds for u in turns)
    assert 0 < tm["thread_cpu_seconds"] <= tm["seconds"] - slept + 0.01
    assert tm["thread_cpu_seconds"] <= tm["process_cpu_seconds"] + 0.01
    assert tm["runqueue_seconds"] is None or 0 <= tm["runqueue_seconds"] <= tm["seconds"] - slept + 0.01
    assert tm["syncs"] == 0 and tm["sync_seconds"] == 0.0  # no store: no weight checks
    json.dumps(tm, allow_nan=False)  # the trajectory log can hold it


def test_async_trainer_rejects_group_recipes(tmp_path):
    with pytest.raises(ValueError, match="recipe"):
        AsyncTrainer(_config(1, recipe="grpo"), tmp_path / "r", console=lambda *a: None)
    with pytest.raises(ValueError, match="recipe"):
        GroupedRayTrainer(_config(1, recipe="sao"), tmp_path / "r", console=lambda *a: None)


# ============================================================================ Ray
@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _critic_values(tr, batch):
    with torch.no_grad():
        hidden = torch.cat([updates.logprobs(tr.learner, batch.select(i), want_hidden=True).hidden
                            for i in updates.micro_batches(len(batch), tr.learner.micro_batch_size)])
        return tr.value_head(hidden).double()


def _expected_advantages(tr, batch, values_before):
    """Skip-observation GAE called directly on the collated batch with the critic's values
    after its K updates (before the policy step); a row that did not terminate bootstraps
    from the updated value of its last action token, or, for a compacted sub-trace whose
    next sub-trace is in the batch, of that sub-trace's first action token
    (``values_before`` is kept for the callers that record it)."""
    obj = tr.objective
    mask = batch.action_mask
    B, L = mask.shape
    values = _critic_values(tr, batch)
    # token rewards built here from the turns: each turn's reward on its last action token
    tok_r = torch.zeros(B, L, dtype=torch.float64)
    last = torch.full((B,), -1, dtype=torch.long)
    for b in range(B):
        for j in range(L):
            if mask[b, j]:
                last[b] = j
                k = int(batch.turn_ids[b, j])
                if j + 1 == L or not mask[b, j + 1]:
                    tok_r[b, j] += float(batch.turn_rewards[b, k])
    terminated = torch.zeros(B, L, dtype=torch.bool)
    terminated[torch.arange(B), last] = batch.terminated
    boot = torch.where(batch.terminated, torch.zeros(B, dtype=torch.float64), values[torch.arange(B), last])
    # a compacted sub-trace whose next sub-trace is in the batch bootstraps from that one's first state (§19)
    for b in range(B):
        for n in range(B):
            if batch.episode_ids[n] == batch.episode_ids[b] and int(batch.segments[n]) == int(batch.segments[b]) + 1:
                boot[b] = values[n, int(mask[n].nonzero()[0])]
    out = returns.token_skip_observation_gae(values, tok_r, mask, gamma=obj.gamma, lam=obj.lam,
                                             terminated=terminated, bootstrap_value=boot)
    return out.advantages, values, tok_r, boot


@pytest.fixture(scope="module")
def async_run(ray_session, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("async") / "run"
    at = AsyncTrainer(_config(3), run_dir, console=lambda *a: None)
    tr = at.trainer
    rec = {"batches": [], "adv": [], "killed": None, "lags": []}
    learn, policy_step, critic_update = tr.learn, updates.policy_step, updates.critic_update

    def spy_learn(trajs):
        v = tr.policy_version
        rec["batches"].append([dict(key=t.metadata["async_key"], episode=t.metadata["async"]["key"], segment=t.segment,
                                    num_segments=t.metadata["num_segments"],
                                    versions=[x.policy_version for x in t.turns]) for t in trajs])
        rec["lags"].extend(v - min(x.policy_version for t in trajs for x in t.turns) for t in trajs)
        if rec["killed"] is None:
            # wait until worker 0 is past the first turn of an episode, then kill it
            deadline = time.time() + 30
            prog = None
            while time.time() < deadline:
                prog = at.worker_progress().get(0)
                if prog is not None and prog[1] >= 1:
                    break
                time.sleep(0.005)
            assert prog is not None and prog[1] >= 1, "worker 0 never reported a second turn"
            at.pool.kill_worker(0)
            rec["killed"] = prog[0]
        return learn(trajs)

    def spy_critic_update(st, batch, *args, **kwargs):
        rec["values_before"] = _critic_values(tr, batch)
        return critic_update(st, batch, *args, **kwargs)

    def spy_policy_step(st, step):
        exp, values, tok_r, boot = _expected_advantages(tr, step.batch, rec.pop("values_before"))
        rec["adv"].append((step.advantages.detach().clone(), exp, values, tok_r, boot, step.batch))
        return policy_step(st, step)

    tr.learn = spy_learn
    updates.policy_step, updates.critic_update = spy_policy_step, spy_critic_update
    t0 = time.perf_counter()
    try:
        summary = at.run()
    finally:
        updates.policy_step, updates.critic_update = policy_step, critic_update
    rec["seconds"] = time.perf_counter() - t0
    state = load_async_state(latest_checkpoint(run_dir))
    return at, summary, rec, run_dir, state


def test_async_run_completes_despite_killed_worker(async_run):
    at, summary, rec, run_dir, _ = async_run
    assert summary["steps"] == 3 and at.trainer.policy_version == 3
    # the killed actor was replaced; its episode (and any queued on it) is counted lost
    assert summary["replaced_workers"] >= 1
    assert summary["lost_episodes"] >= 1
    assert rec["killed"] in at.lost_keys
    trained_episodes = {x["episode"] for b in rec["batches"] for x in b}
    assert not trained_episodes & set(at.lost_keys)
    # nothing of a lost episode was ever logged (never half-trained)
    logged = read_trajectories(run_dir / "trajectories.jsonl")
    assert not {t.metadata["async"]["key"] for t in logged} & set(at.lost_keys)
    rows = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["faults/lost_episodes"] >= 1 and rows[-1]["faults/replaced_workers"] >= 1


def test_async_trajectories_trained_at_most_once_and_lag_bounded(async_run):
    at, _, rec, run_dir, _ = async_run
    keys = [x["key"] for b in rec["batches"] for x in b]
    assert len(keys) == len(set(keys)) >= 12
    assert all(0 <= lag <= at.acfg.max_lag for lag in rec["lags"])
    # the log agrees: each trained trajectory appears once with status "trained"
    logged = [t for t in read_trajectories(run_dir / "trajectories.jsonl") if t.metadata["async"]["status"] == "trained"]
    assert len(logged) == len(keys)
    assert all(t.metadata["async"]["lag"] <= at.acfg.max_lag for t in logged)


def test_async_compaction_subtraces_all_trained_together(async_run):
    _, _, rec, _, _ = async_run
    for batch in rec["batches"]:
        by_ep = {}
        for x in batch:
            by_ep.setdefault(x["episode"], []).append(x["segment"])
        for segs in by_ep.values():
            assert sorted(segs) == [0, 1]  # both sub-traces of every episode, in one update
        assert all(x["num_segments"] == 2 for x in batch)
    # each sub-trace row gets its own token-level advantages and values
    adv, exp, values, tok_r, boot, batch = rec["adv"][0]
    assert len(batch) == len(rec["batches"][0]) >= 4
    assert bool((batch.action_mask.sum(1) > 0).all())


def test_async_learner_advantages_equal_skip_observation_gae(async_run):
    _, _, rec, _, _ = async_run
    assert len(rec["adv"]) == 3
    for adv, exp, values, tok_r, boot, batch in rec["adv"]:
        m = batch.action_mask
        assert torch.allclose(adv[m].double(), exp[m], atol=1e-6, rtol=1e-6)
        # gamma = lam = 1 (SAO): A_t = (rewards from t on) + bootstrap - V_t, by hand
        for b in range(len(batch)):
            idx = m[b].nonzero().squeeze(-1).tolist()
            future = 0.0
            for j in reversed(idx):
                future += float(tok_r[b, j])
                assert float(adv[b, j]) == pytest.approx(future + float(boot[b]) - float(values[b, j]), abs=1e-5)


def test_async_metrics_logged(async_run):
    _, _, _, run_dir, _ = async_run
    rows = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    need = ["lag/mean", "lag/max", "lag/hist_0", "lag/hist_1", "lag/dropped_frac", "trust/rejected_low",
            "trust/rejected_high", "critic/explained_variance", "throughput/trajectories_per_s",
            "throughput/tokens_per_s", "time/learner_idle", "queue/in_flight", "queue/pending", "faults/lost_episodes",
            "partial/mixed_frac"]
    for r in rows:
        for k in need:
            assert k in r and math.isfinite(r[k]), k
        assert r["lag/hist_0"] + r["lag/hist_1"] + r["lag/hist_over"] == r["batch/trajectories"]
        assert r["lag/max"] <= 1 and r["lag/hist_over"] == 0


def test_async_resume_trains_the_buffer_and_reruns_in_flight(async_run):
    at, _, _, run_dir, state = async_run
    assert state.step == 3 and len(state.trained) == at.gate.trained
    in_flight = [f.key for f in state.in_flight]
    assert len(in_flight) >= 1
    # one worker is enough for the last update (and boots faster)
    cfg = _config(4, asynchronous={"workers": 1})
    at2 = AsyncTrainer(cfg, run_dir, resume=True, console=lambda *a: None)
    assert at2.trainer.step == 3 and at2.trainer.policy_version == 3
    assert at2.counters["rerun_on_resume"] == len(in_flight) and at2.counters["lost_on_resume"] == 0
    assert [f.key for f, _task in at2._rerun] == in_flight
    assert at2.counters["lost_episodes"] == state.counters["lost_episodes"] >= 1
    summary = at2.run()
    assert summary["steps"] == 4 and at2.trainer.policy_version == 4
    rows = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["faults/rerun_on_resume"] == len(in_flight) and rows[-1]["faults/lost_on_resume"] == 0
    trained = [(t.metadata["async"]["key"], t.segment) for t in read_trajectories(run_dir / "trajectories.jsonl") if t.metadata["async"]["status"] == "trained"]
    assert len(trained) == len(set(trained))  # nothing trained twice across the resume


def test_grouped_baseline_measures_group_wait(ray_session, tmp_path):
    cfg = _config(1, recipe="grpo", train={"steps": 1, "prompts_per_step": 1, "group_size": 2, "micro_batch_size": 4},
                  asynchronous={"enabled": False, "workers": 1})
    gt = GroupedRayTrainer(cfg, tmp_path / "g", console=lambda *a: None)
    summary = gt.run()
    assert summary["steps"] == 1 and summary["group_size"] == 2
    (row,) = [r for r in read_metrics(tmp_path / "g") if r["kind"] == "train"]
    assert row["group/wait_W"] >= 0 and row["lag/max"] == 0
    assert row["group/wait_W"] == pytest.approx(summary["group_wait_W_total"])
    trajs = read_trajectories(tmp_path / "g" / "trajectories.jsonl")
    assert len({t.episode_id for t in trajs}) == 2 and len({t.task_id for t in trajs}) == 1


def test_ray_learners_use_the_trainers_public_interface_and_no_recipe_names():
    """The Ray learners reach the Trainer through its public interface only (no ``tr._x``,
    ``self.trainer._x``), and nothing in train/ compares a recipe, loss or estimator name:
    the trainers read the Objective's declared properties (kind, ratio_source, ...)."""
    import ast
    import inspect
    import pkgutil

    import trajgrad.train as train_pkg
    from trajgrad.objective import RECIPES
    from trajgrad.registry import ADVANTAGE_ESTIMATORS, POLICY_TERMS
    from trajgrad.train import async_trainer, grouped, ray_learner

    for mod in (ray_learner, async_trainer, grouped):
        for n in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                base = n.value
                on_trainer = (isinstance(base, ast.Name) and base.id == "tr") or \
                    (isinstance(base, ast.Attribute) and base.attr == "trainer")
                assert not on_trainer, f"{mod.__name__}: line {n.lineno} touches Trainer.{n.attr}"
    # "none" is also every switch's off value (kl_placement, ratio_source), not a name test
    names = (set(RECIPES) | set(POLICY_TERMS) | set(ADVANTAGE_ESTIMATORS)) - {"none"}
    for info in pkgutil.iter_modules(train_pkg.__path__):
        if info.name in ("config", "run", "checkpoint"):  # presets and their names live in config
            continue
        mod = __import__(f"trajgrad.train.{info.name}", fromlist=["_"])
        for n in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(n, ast.Compare):
                consts = [c.value for c in [n.left, *n.comparators] if isinstance(c, ast.Constant)]
                assert not set(consts) & names, f"train/{info.name}.py:{n.lineno} compares a recipe name {consts}"
