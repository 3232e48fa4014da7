"""Tests for trajgrad.distributed: exact global normalization across ranks (§13, §24).

One 2-process gloo job (spawned once per module) computes, for every loss x aggregation
mode x number of micro-batches, the gradient of a tiny float64 linear policy under

* DDP + ``Normalizer(mode)`` (global count, divided by the world size),
* no DDP + ``Normalizer(mode, grad_average_over_ranks=False)`` + ``sync_gradients_sum``,
* the naive scheme (each micro-batch normalized by its own count, DDP average),

and the parent compares them with the single-process gradient of the same loss on the
concatenated batch. Ranks hold different numbers of sequences and of tokens, and
micro-batches are padded to different lengths.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import queue as queue_mod
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad import distributed as D
from trajgrad.aggregate import MODES, Normalizer
from trajgrad.losses import (
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    reinforce_loss,
    sao_dis_loss,
    sapo_loss,
)

WORLD = 2
F, V = 4, 6  # feature size, vocabulary size of the linear policy
N_SEQ = 14
RANK_SLICES = [(0, 5), (5, N_SEQ)]  # rank 0: 5 sequences (one empty), rank 1: 9
EMPTY_SEQ = 4  # alone in its micro-batch when rank 0 splits into 4
CONSTANT = 12.0  # C of seq_sum_constant, fixed for every micro-batch
ACCUM = (1, 2, 4)
NAIVE_ACCUM = (1, 4)  # negative control: without and with gradient accumulation
LOSSES = ("reinforce", "ppo", "gspo", "gspo_token", "sapo", "sao")


# ----------------------------------------------------------------------------- data ---


def _w0() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return 0.5 * torch.randn(F, V, generator=g, dtype=torch.float64)


def _token_logp(w: torch.Tensor, feats: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(feats @ w, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def make_sequences() -> list:
    """14 ragged sequences: prompt slots (mask 0), an observation gap, one empty sequence."""
    return list(_make_sequences())


@functools.lru_cache(maxsize=1)
def _make_sequences() -> tuple:
    g = torch.Generator().manual_seed(0)
    w0 = _w0()
    seqs = []
    for i in range(N_SEQ):
        length = int(torch.randint(3, 11, (1,), generator=g))
        mask = torch.ones(length, dtype=torch.bool)
        mask[: int(torch.randint(0, 3, (1,), generator=g))] = False  # prompt tail
        if i % 3 == 0 and length > 5:
            mask[length // 2] = False  # tool observation inside the response
        if i == EMPTY_SEQ:
            mask[:] = False
        feats = torch.randn(length, F, generator=g, dtype=torch.float64)
        targets = torch.randint(0, V, (length,), generator=g)
        with torch.no_grad():
            base = _token_logp(w0, feats, targets)
        old = base + 0.3 * torch.randn(length, generator=g, dtype=torch.float64)
        adv_tok = torch.randn(length, generator=g, dtype=torch.float64)
        adv_seq = torch.randn((), generator=g, dtype=torch.float64)
        seqs.append(dict(feats=feats, targets=targets, mask=mask, old=old, adv_tok=adv_tok, adv_seq=adv_seq))
    return tuple(seqs)  # read-only: collate() copies


def collate(seqs: list, length: int | None = None, *, clean: bool = False) -> dict:
    """Right-pad to ``length`` (default: longest).

    Masked evidence slots hold NaN/+-inf (0 with ``clean``); they must not matter.
    """
    length = max(len(s["mask"]) for s in seqs) if length is None else length
    b = len(seqs)
    nan, inf = (0.0, 0.0) if clean else (float("nan"), float("inf"))
    out = dict(
        feats=torch.zeros(b, length, F, dtype=torch.float64),
        targets=torch.zeros(b, length, dtype=torch.long),
        mask=torch.zeros(b, length, dtype=torch.bool),
        old=torch.full((b, length), nan, dtype=torch.float64),
        adv_tok=torch.full((b, length), inf, dtype=torch.float64),
        adv_seq=torch.zeros(b, dtype=torch.float64),
    )
    for i, s in enumerate(seqs):
        n = len(s["mask"])
        out["feats"][i, :n] = s["feats"]
        out["targets"][i, :n] = s["targets"]
        out["mask"][i, :n] = s["mask"]
        out["old"][i, :n] = torch.where(s["mask"], s["old"], torch.tensor(nan, dtype=torch.float64))
        out["adv_tok"][i, :n] = torch.where(s["mask"], s["adv_tok"], torch.tensor(-inf, dtype=torch.float64))
        out["adv_seq"][i] = s["adv_seq"] if bool(s["mask"].any()) else nan
    return out


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(_w0().clone())

    def forward(self, feats: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _token_logp(self.w, feats, targets)


def loss_value(name: str, logp: torch.Tensor, batch: dict, mode: str, denominator=None) -> torch.Tensor:
    kw = dict(aggregation=mode, denominator=denominator)
    if mode == "seq_sum_constant":
        kw["constant"] = CONSTANT
    m, old, adv = batch["mask"], batch["old"], batch["adv_tok"]
    if name == "reinforce":
        return reinforce_loss(logp, adv, m, **kw).loss
    if name == "ppo":
        return ppo_clip_loss(logp, old, adv, m, eps_low=0.2, **kw).loss
    if name == "gspo":
        return gspo_loss(logp, old, batch["adv_seq"], m, eps_low=0.2, eps_high=0.2, **kw).loss
    if name == "gspo_token":
        return gspo_token_loss(logp, old, adv, m, eps_low=0.2, eps_high=0.2, **kw).loss
    if name == "sapo":
        return sapo_loss(logp, old, adv, m, **kw).loss
    if name == "sao":
        return sao_dis_loss(logp, old, adv, m, **kw).loss
    raise AssertionError(name)


def reference_grad(name: str, mode: str) -> torch.Tensor:
    """Single-process gradient of the loss of the concatenated batch (local denominator)."""
    return _reference_grad(name, mode).clone()


@functools.lru_cache(maxsize=None)
def _reference_grad(name: str, mode: str) -> torch.Tensor:
    batch = collate(make_sequences())
    policy = Policy()
    loss_value(name, policy(batch["feats"], batch["targets"]), batch, mode).backward()
    return policy.w.grad.detach().clone()


# -------------------------------------------------------------------- child process ---


def _micro_batches(rank: int, k: int) -> list:
    lo, hi = RANK_SLICES[rank]
    mine = make_sequences()[lo:hi]
    return [collate(D.shard(mine, i, k)) for i in range(k)]


def _step(model, policy: Policy, plain: Policy, mbs: list, name: str, mode: str, scheme: str) -> torch.Tensor:
    """One optimizer step's gradient on this rank.

    ``model`` is the DDP wrapper of ``policy``; ``plain`` is an unwrapped copy used with
    ``sync_gradients_sum``.
    """
    if scheme == "sum":
        plain.zero_grad(set_to_none=True)
        d = Normalizer.from_masks([mb["mask"] for mb in mbs], mode, grad_average_over_ranks=False).denominator()
        for mb in mbs:
            loss_value(name, plain(mb["feats"], mb["targets"]), mb, mode, denominator=d).backward()
        D.sync_gradients_sum(plain.parameters())
        return plain.w.grad.detach().clone()
    policy.zero_grad(set_to_none=True)
    d = Normalizer.from_masks([mb["mask"] for mb in mbs], mode).denominator()  # D_global / W
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            logp = model(mb["feats"], mb["targets"])
            if scheme == "ddp":
                loss = loss_value(name, logp, mb, mode, denominator=d)
            else:  # naive: own denominator per micro-batch, mean over micro-batches
                loss = loss_value(name, logp, mb, mode) / len(mbs)
            loss.backward()
    return policy.w.grad.detach().clone()


# ------------------------------------------------------------------ DPO (§13) ---
N_PAIRS = 5
DPO_SPLITS = {"unequal": [(0, 1), (1, N_PAIRS)], "empty": [(0, 0), (0, N_PAIRS)]}  # rank 0: 1 pair / none


def _dpo_pairs():
    """Chosen/rejected sequences of the linear policy, with reference log-probs under w0 + noise."""
    seqs = make_sequences()
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(N_PAIRS):
        c, r = seqs[(2 * i) % N_SEQ], seqs[(2 * i + 1) % N_SEQ]
        if i == 0:
            c = seqs[5]  # every pair has action tokens on both sides
        out.append((c, r, float(torch.randn((), generator=g, dtype=torch.float64)),
                    float(torch.randn((), generator=g, dtype=torch.float64))))
    return out


def _dpo_seq_logp(policy: Policy, seqs: list) -> torch.Tensor:
    from trajgrad.losses import sequence_logp

    b = collate(seqs)
    return sequence_logp(torch.where(b["mask"], policy(b["feats"], b["targets"]), 0.0), b["mask"])


def _dpo_grad(pairs: list, num_pairs: int, scheme: str) -> torch.Tensor:
    """This rank's DPO gradient after the sum over ranks. ``scheme="global"``: the trainer's
    share (local sum / global pair count, :func:`trajgrad.train.offline.dpo_pair_loss`);
    ``"per_rank_mean"``: the previous per-rank mean divided by the world size."""
    from trajgrad.objective import RECIPES
    from trajgrad.train.offline import dpo_pair_loss

    obj = RECIPES["dpo"]
    policy = Policy()
    if pairs:
        pc = _dpo_seq_logp(policy, [p[0] for p in pairs])
        pr = _dpo_seq_logp(policy, [p[1] for p in pairs])
        with torch.no_grad():
            ref = Policy()
            rc = _dpo_seq_logp(ref, [p[0] for p in pairs]) + torch.tensor([p[2] for p in pairs], dtype=torch.float64)
            rr = _dpo_seq_logp(ref, [p[1] for p in pairs]) + torch.tensor([p[3] for p in pairs], dtype=torch.float64)
        res, share = dpo_pair_loss(obj, pc, pr, rc, rr, num_pairs)
        (share if scheme == "global" else res.loss / WORLD).backward()
    D.sync_gradients_sum(policy.parameters())
    return policy.w.grad.detach().clone()


def _dpo_checks(rank: int) -> dict:
    pairs = _dpo_pairs()
    out = {}
    for split, slices in DPO_SPLITS.items():
        mine = pairs[slice(*slices[rank])]
        for scheme in ("global", "per_rank_mean"):
            out[(split, scheme)] = _dpo_grad(mine, N_PAIRS, scheme).tolist()
    return out


def _metric_checks(rank: int) -> dict:
    out = {}
    out["weighted"] = D.all_reduce_metrics(
        {"loss": 1.0 + 2.0 * rank, "clip": torch.tensor(0.5 + rank), "tokens": 10.0},
        {"loss": 10.0 + 20.0 * rank},
    )
    # rank 1 has no tokens: its NaN fraction is left out by its zero weight
    out["zero_weight"] = D.all_reduce_metrics({"x": 4.0 if rank == 0 else float("nan")}, 2.0 if rank == 0 else 0.0)
    out["all_zero"] = D.all_reduce_metrics({"x": 1.0}, {"x": 0.0})
    for case, kwargs in {
        "negative_weight": dict(metrics={"a": 1.0}, weights={"a": -1.0 if rank == 1 else 1.0}),
        "nan_weight": dict(metrics={"a": 1.0}, weights=float("nan") if rank == 0 else 1.0),
        "key_mismatch": dict(metrics={"a": 1.0, ("b" if rank == 0 else "c"): 2.0}),
    }.items():
        try:
            D.all_reduce_metrics(**kwargs)
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
    return out


def _worker(rank: int, port: int, q) -> None:
    try:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        info = D.init_from_env("gloo", timeout=datetime.timedelta(seconds=30))
        res = {
            "info": tuple(info),
            "info_again": tuple(D.init_from_env()),  # idempotent
            "get_info": tuple(D.get_info()),
            "is_main": D.is_main(),
            "metrics": _metric_checks(rank),
            "grads": {},
        }
        policy, plain = Policy(), Policy()
        model = D.wrap_ddp(policy)
        res["ddp_type"] = type(model).__name__
        for k in ACCUM:
            mbs = _micro_batches(rank, k)
            for name in LOSSES:
                for mode in MODES:
                    for scheme in ("ddp", "sum", "naive") if k in NAIVE_ACCUM else ("ddp", "sum"):
                        g = _step(model, policy, plain, mbs, name, mode, scheme)
                        # plain floats: tensors in a Queue would travel as shared memory
                        # that vanishes when this process exits
                        res["grads"][(name, mode, k, scheme)] = g.tolist()
        res["dpo"] = _dpo_checks(rank)
        res["rank_helpers"] = {
            "gather": D.gather_objects({"rank": rank}),
            "sum": D.sum_over_ranks(rank + 0.5),
            "min": D.min_over_ranks(rank + 3),
            # rank 0 logs "c", rank 1 logs "b"; weights 1 and 2
            "mean": D.mean_metrics_over_ranks({"a": 1.0 + rank, ("b" if rank else "c"): 2.0 + rank}, weight=1 + rank),
            "zero_weight": D.mean_metrics_over_ranks({"x": 5.0 if rank == 0 else float("nan")}, weight=1 - rank),
        }
        D.barrier()
        res["seconds"] = time.perf_counter() - t0
        q.put(("ok", rank, res))
        D.cleanup()
        res_after = D.is_distributed()
        q.put(("cleanup", rank, res_after))
        # end without the interpreter's teardown, where gloo's worker threads can abort the
        # process (trajgrad.train.run.end_distributed_worker); the queue's feeder is drained first
        q.close()
        q.join_thread()
        os._exit(0)
    except BaseException:  # report everything, never hang the parent
        q.put(("error", rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(timeout_s: float = 150.0) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, q), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, cleaned, errors = {}, {}, []
    deadline = time.monotonic() + timeout_s
    try:
        while len(cleaned) < WORLD and not errors:
            try:
                kind, rank, payload = q.get(timeout=0.5)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout_s}s")
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)  # let a queued traceback arrive first
                    try:
                        while True:
                            kind, rank, payload = q.get_nowait()
                            if kind == "error":
                                errors.append(f"rank {rank}:\n{payload}")
                    except queue_mod.Empty:
                        pass
                    errors.append(f"child exit codes {[p.exitcode for p in procs]}")
                continue
            if kind == "error":
                errors.append(f"rank {rank}:\n{payload}")
            elif kind == "ok":
                results[rank] = payload
            else:
                cleaned[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise RuntimeError("distributed job failed:\n" + "\n".join(errors))
    for r in range(WORLD):
        results[r]["still_initialized_after_cleanup"] = cleaned[r]
        results[r]["grads"] = {k: torch.tensor(v, dtype=torch.float64) for k, v in results[r]["grads"].items()}
        results[r]["dpo"] = {k: torch.tensor(v, dtype=torch.float64) for k, v in results[r]["dpo"].items()}
    return results


@pytest.fixture(scope="module")
def job() -> dict:
    try:
        return _run_job()
    except RuntimeError as first:  # e.g. the free port was taken in between: retry once
        try:
            return _run_job()
        except RuntimeError as second:
            raise RuntimeError(f"first attempt:\n{first}\nsecond attempt:\n{second}") from None


# ----------------------------------------------------------- distributed gradients ---


def test_ranks_hold_unequal_counts():
    """The premise of the negative control: ranks differ in tokens AND in sequences."""
    counts = []
    for rank in range(WORLD):
        m = collate(make_sequences()[slice(*RANK_SLICES[rank])])["mask"]
        counts.append((int(m.sum()), int(m.any(-1).sum())))
    assert counts[0][0] != counts[1][0] and counts[0][1] != counts[1][1]
    assert [len(_micro_batches(0, 4)[i]["mask"]) for i in range(4)] == [2, 1, 1, 1]
    assert not bool(_micro_batches(0, 4)[3]["mask"].any())  # an all-padding micro-batch


@pytest.mark.parametrize("k", ACCUM)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_ddp_gradient_equals_full_batch_gradient(job, name, mode, k):
    ref = reference_grad(name, mode)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-2  # not a vacuous comparison
    for rank in range(WORLD):
        g = job[rank]["grads"][(name, mode, k, "ddp")]
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("k", ACCUM)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_sum_reduction_without_ddp_equals_full_batch_gradient(job, name, mode, k):
    ref = reference_grad(name, mode)
    for rank in range(WORLD):
        torch.testing.assert_close(job[rank]["grads"][(name, mode, k, "sum")], ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("k", NAIVE_ACCUM)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_negative_control_local_normalization_differs(job, name, mode, k):
    """Averaging locally normalized losses reweights ranks: the gradient is different."""
    ref = reference_grad(name, mode)
    g0 = job[0]["grads"][(name, mode, k, "naive")]
    g1 = job[1]["grads"][(name, mode, k, "naive")]
    torch.testing.assert_close(g0, g1, rtol=0, atol=1e-12)  # DDP did synchronize them
    assert (g0 - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("split", sorted(DPO_SPLITS))
def test_dpo_with_unequal_shards_equals_the_single_process_gradient(job, split):
    """DPO's denominator is the step's pair count over every rank (§13): with 1 + 4 pairs,
    and with a rank holding none (it trains no duplicated pair), the summed gradient is the
    single-process gradient of the mean over all pairs; the previous per-rank mean / world
    size is not."""
    assert [len(range(*sl)) for sl in DPO_SPLITS[split]] in ([1, 4], [0, 5])
    ref = _dpo_grad(_dpo_pairs(), N_PAIRS, "global")  # one process, all pairs: the plain mean
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-3
    for rank in range(WORLD):
        torch.testing.assert_close(job[rank]["dpo"][(split, "global")], ref, rtol=0, atol=1e-6)
        assert (job[rank]["dpo"][(split, "per_rank_mean")] - ref).abs().max().item() > 1e-3


def test_dpo_pair_loss_is_the_mean_over_pairs_in_one_process():
    from trajgrad.losses import dpo_loss
    from trajgrad.objective import RECIPES
    from trajgrad.train.offline import dpo_pair_loss

    g = torch.Generator().manual_seed(3)
    pc, pr, rc, rr = (torch.randn(4, generator=g, dtype=torch.float64) for _ in range(4))
    obj = RECIPES["dpo"]
    res, share = dpo_pair_loss(obj, pc, pr, rc, rr, 4)
    torch.testing.assert_close(share, dpo_loss(pc, pr, rc, rr, beta=obj.beta).loss, rtol=0, atol=0)
    _, part = dpo_pair_loss(obj, pc[:1], pr[:1], rc[:1], rr[:1], 4)
    torch.testing.assert_close(part, dpo_loss(pc[:1], pr[:1], rc[:1], rr[:1], beta=obj.beta).loss / 4, rtol=0, atol=1e-15)
    for bad in (3, 0, 4.0, True):
        with pytest.raises(ValueError, match="^num_pairs"):
            dpo_pair_loss(obj, pc, pr, rc, rr, bad)


def test_rank_helpers_across_ranks(job):
    for rank in range(WORLD):
        h = job[rank]["rank_helpers"]
        assert h["gather"] == [{"rank": 0}, {"rank": 1}]
        assert h["sum"] == 2.0 and h["min"] == 3
        # a: (1*1 + 2*2) / 3; b only on rank 1, c only on rank 0
        assert h["mean"] == pytest.approx({"a": 5.0 / 3.0, "b": 3.0, "c": 2.0}, abs=1e-12)
        assert h["zero_weight"] == {"x": 5.0}


def test_rank_helpers_single_process():
    assert D.gather_objects(3) == [3]
    assert D.sum_over_ranks(torch.tensor(2.5)) == 2.5 and D.min_over_ranks(4) == 4
    assert D.mean_metrics_over_ranks({"a": 1.0}, weight=0) == {"a": 1.0}
    for call, arg in ((lambda: D.min_over_ranks(1.5), "value"), (lambda: D.sum_over_ranks("x"), "value"),
                      (lambda: D.mean_metrics_over_ranks({}, weight=-1.0), "weight"),
                      (lambda: D.mean_metrics_over_ranks({}, weight=float("nan")), "weight")):
        with pytest.raises(ValueError, match=f"^{arg}"):
            call()


def test_process_info_and_lifecycle(job):
    for rank in range(WORLD):
        r = job[rank]
        expect = (rank, WORLD, rank, rank == 0)
        assert r["info"] == expect and r["info_again"] == expect and r["get_info"] == expect
        assert r["is_main"] is (rank == 0)
        assert r["ddp_type"] == "DistributedDataParallel"
        assert r["still_initialized_after_cleanup"] is False


def test_all_reduce_metrics_across_ranks(job):
    for rank in range(WORLD):
        m = job[rank]["metrics"]
        # loss: (10*1 + 30*3) / (10 + 30) = 2.5; clip: (0.5 + 1.5) / 2 = 1; tokens: 10
        assert m["weighted"] == pytest.approx({"loss": 2.5, "clip": 1.0, "tokens": 10.0}, abs=1e-12)
        assert list(m["weighted"]) == ["loss", "clip", "tokens"]
        assert m["zero_weight"] == {"x": 4.0}
        assert math.isnan(m["all_zero"]["x"])
        # an invalid weight on ONE rank raises on EVERY rank (nobody is left waiting)
        assert m["negative_weight"].startswith("weights")
        assert m["nan_weight"].startswith("weights")
        assert m["key_mismatch"].startswith("metrics")


# ------------------------------------------------- the same algebra in one process ---


@settings(max_examples=20, deadline=None)
@given(
    cuts=st.lists(st.integers(1, N_SEQ - 1), min_size=1, max_size=5, unique=True),
    n_ranks=st.integers(1, 4),
    mode=st.sampled_from(MODES),
    name=st.sampled_from(LOSSES),
)
def test_property_any_split_matches_full_batch(cuts, n_ranks, mode, name):
    """Any split into micro-batches, dealt to ``n_ranks`` simulated ranks, with the global
    count divided by the rank count and the per-rank gradients averaged (DDP's rule),
    reproduces the full-batch gradient; padding each micro-batch to its own length."""
    seqs = make_sequences()
    bounds = [0, *sorted(cuts), N_SEQ]
    mbs = [collate(seqs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    per_rank = [D.shard(mbs, r, n_ranks, strategy="strided") for r in range(n_ranks)]
    total = Normalizer.from_masks([mb["mask"] for mb in mbs], mode).global_count()
    d = total.clamp_min(1.0) / n_ranks
    grads = []
    for rank_mbs in per_rank:
        policy = Policy()
        for mb in rank_mbs:
            loss_value(name, policy(mb["feats"], mb["targets"]), mb, mode, denominator=d).backward()
        grads.append(policy.w.grad if policy.w.grad is not None else torch.zeros_like(policy.w))
    torch.testing.assert_close(sum(grads) / n_ranks, reference_grad(name, mode), rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_reference_ignores_nan_inf_in_masked_slots(name, mode):
    """The evidence used above carries NaN/inf in masked slots; a clean copy agrees."""
    batch = collate(make_sequences(), clean=True)
    policy = Policy()
    loss = loss_value(name, policy(batch["feats"], batch["targets"]), batch, mode)
    loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(policy.w.grad, reference_grad(name, mode), rtol=0, atol=0)


def test_hand_computed_token_mean_reweighting():
    """§13 by hand: rank 0 has 1 token with gradient g, rank 1 has 3 tokens with 0.

    Global token mean weighs the token by 1/4; averaging local means by (1/1)/2 = 1/2.
    With REINFORCE (-A*logp), dL/dlogp at that token is -A/4 globally vs -A/2 locally.
    """
    a = 2.0
    logp0 = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    adv0 = torch.tensor([[a]], dtype=torch.float64)
    m0, m1 = torch.ones(1, 1), torch.ones(1, 3)
    d_global = Normalizer.from_masks([m0, m1], "token_mean").global_count()  # 4 tokens
    assert d_global.item() == 4.0
    (g_global,) = torch.autograd.grad(reinforce_loss(logp0, adv0, m0, denominator=d_global).loss, logp0)
    (g_local,) = torch.autograd.grad(0.5 * reinforce_loss(logp0, adv0, m0).loss, logp0)
    assert g_global.item() == pytest.approx(-a / 4)
    assert g_local.item() == pytest.approx(-a / 2)


# --------------------------------------------------------------- single-process API ---


def test_shard_worked_examples():
    items = list(range(10))
    assert [D.shard(items, r, 3) for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [D.shard(items, r, 3, strategy="strided") for r in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [D.shard(["a", "b"], r, 4) for r in range(4)] == [["a"], ["b"], [], []]
    assert D.shard([], 0, 2) == [] and D.shard((1, 2, 3), 0, 1) == [1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 60), world=st.integers(1, 9), strategy=st.sampled_from(D.SHARD_STRATEGIES))
def test_property_shard_partitions(n, world, strategy):
    items = [f"x{i}" for i in range(n)]
    parts = [D.shard(items, r, world, strategy=strategy) for r in range(world)]
    flat = [x for p in parts for x in p]
    assert sorted(flat, key=lambda s: int(s[1:])) == items  # every item exactly once
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    if strategy == "contiguous":
        assert flat == items  # blocks in order
    assert parts == [D.shard(items, r, world, strategy=strategy) for r in range(world)]  # deterministic


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(rank=2, world_size=2), "rank"),
        (dict(rank=-1, world_size=2), "rank"),
        (dict(rank=0, world_size=0), "world_size"),
        (dict(rank=0, world_size=1.5), "world_size"),
        (dict(rank=0, world_size=2, strategy="random"), "strategy"),
    ],
)
def test_shard_bad_input(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        D.shard([1, 2, 3], **kwargs)


def test_all_reduce_metrics_single_process():
    assert not D.is_distributed()
    m = {"b": 2.0, "a": torch.tensor(3.0), "c": torch.tensor([5.0])}
    out = D.all_reduce_metrics(m)
    assert out == {"b": 2.0, "a": 3.0, "c": 5.0} and list(out) == ["b", "a", "c"]
    assert D.all_reduce_metrics(m, {"a": 7.0}) == {"b": 2.0, "a": 3.0, "c": 5.0}
    out = D.all_reduce_metrics({"x": float("nan"), "y": 1.0}, {"x": 0.0})
    assert math.isnan(out["x"]) and out["y"] == 1.0  # zero total weight: undefined
    assert math.isnan(D.all_reduce_metrics({"x": float("nan")})["x"])  # NaN is reported, not hidden
    assert D.all_reduce_metrics({}) == {}


@pytest.mark.parametrize(
    "args, arg",
    [
        (({"a": 1.0}, {"a": -1.0}), "weights"),
        (({"a": 1.0}, {"a": float("inf")}), "weights"),
        (({"a": 1.0}, {"b": 1.0}), "weights"),
        (({"a": 1.0}, "heavy"), "weights"),
        (({"a": torch.ones(2)},), "metrics"),
        (({"a": "high"},), "metrics"),
        (([1.0],), "metrics"),
    ],
)
def test_all_reduce_metrics_bad_input(args, arg):
    with pytest.raises(ValueError, match=arg):
        D.all_reduce_metrics(*args)


def test_single_process_helpers_are_identities(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert D.init_from_env() == D.DistInfo(0, 1, 0, True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    info = D.init_from_env()
    assert info == (0, 1, 0, True) and not info.distributed and not D.is_distributed()
    assert D.get_info() == info and D.is_main()
    model = torch.nn.Linear(2, 1)
    assert D.wrap_ddp(model) is model
    model(torch.ones(1, 2)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    D.sync_gradients_sum(model.parameters())
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    D.barrier()
    D.cleanup()
    D.cleanup()


@pytest.mark.parametrize(
    "env, arg",
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "LOCAL_RANK"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "x"}, "MASTER_PORT"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "LOCAL_RANK"),
    ],
)
def test_init_from_env_bad_environment(monkeypatch, env, arg):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=arg):
        D.init_from_env("gloo")
    assert not D.is_distributed()
