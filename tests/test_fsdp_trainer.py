"""The trainer under FSDP2 (``dist.fsdp: true``): ``torchrun --nproc_per_node 2`` (gloo, CPU)
runs ``trajgrad train`` with the tiny preset end to end (evaluation before and after, the
SFT warm start, 2 GRPO steps, checkpoints), and a checkpoint it wrote loads in one process
as the policy that sampled the next step.

The update step itself (sharded gradients = the single-process gradient) is tested in
tests/test_fsdp.py; this is the loop around it: sampling and evaluation inside
``fsdp.gathered`` (ranks sample different lengths, only rank 0 evaluates), the same
learner forward calls on every rank, and checkpoints gathered on every rank.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from trajgrad.rollout import collate, read_trajectories
from trajgrad.train.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SETTINGS = {
    "dist.fsdp": "true", "train.steps": 2, "train.prompts_per_step": 2, "train.group_size": 2,
    "train.micro_batch_size": 4, "sampling.max_new_tokens": 8, "sft.steps": 2, "sft.batch_size": 4,
    "task.n_train": 16, "task.n_heldout": 4, "checkpoint.every": 1, "checkpoint.keep": 5,
    "model.tiny.hidden_size": 32, "model.tiny.heads": 2, "log.tensorboard": "false", "log.progress": "false",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    sets = [a for k, v in SETTINGS.items() for a in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "trajgrad", "train", "--preset", "tiny", *sets, "--run-dir", str(run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = job.communicate(timeout=180)
    except subprocess.TimeoutExpired:  # a hang must fail the test, never the CI job
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        pytest.fail("torchrun under dist.fsdp did not finish in 180 s:\n" + out.decode()[-3000:])
    assert job.returncode == 0, out.decode()[-4000:]
    return run_dir


def test_two_ranks_train_two_steps_with_evaluations(run):
    rows = read_metrics(run)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in rows if r["kind"] == "sft"] == [0, 1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_before"]["n"] == 4 and summary["eval_after"]["n"] == 4
    # both ranks sampled and trained: one prompt group of 2 each per step
    for rank in (0, 1):
        trajs = read_trajectories(run / f"trajectories.rank{rank}.jsonl")
        assert len(trajs) == 4 and {t.turns[0].policy_version for t in trajs} == {0, 1}
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert names == ["step-000000", "step-000001", "step-000002"]


def test_a_checkpoint_loads_in_one_process_as_the_policy_that_sampled_the_next_step(run):
    """The step-1 checkpoint (full tensors gathered from both ranks) in a single unsharded
    model gives the log-probs the sharded policy recorded while sampling step 2."""
    from trajgrad.model.learner import learner_logprobs
    from trajgrad.train.checkpoint import load_checkpoint
    from trajgrad.train.config import Config
    from trajgrad.train.setup import build_learner

    cfg = Config.model_validate(json.loads((run / "config.json").read_text()))
    cfg = cfg.model_copy(update={"dist": cfg.dist.model_copy(update={"fsdp": False})})
    st, tok = build_learner(cfg, cfg.objective())
    model = st.model
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = load_checkpoint(run, modules={"policy": model}, optimizers={"policy": st.optimizer},
                            path=run / "checkpoints" / "step-000001", restore_rng=False)
    assert state.step == 1
    assert all(not torch.equal(p, initial[n]) for n, p in model.named_parameters() if ".layers." in n)
    # AdamW's moments of the sharded layers were gathered: full shapes, one state per parameter
    opt_state = st.optimizer.state_dict()["state"]
    assert len(opt_state) == len(list(model.parameters()))
    for p, s in zip(model.parameters(), (opt_state[i] for i in sorted(opt_state))):
        assert s["exp_avg"].shape == p.shape
    model.eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for rank in (0, 1):
        trajs = [t for t in read_trajectories(run / f"trajectories.rank{rank}.jsonl") if t.turns[0].policy_version == 1]
        batch = collate(trajs, pad)
        with torch.no_grad():
            logp = learner_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask,
                                    temperature=st.temperature).logp
        m = batch.action_mask.bool()
        assert m.sum() > 4
        assert float((logp[m].double() - batch.old_logp[m].double()).abs().max()) < 1e-4
