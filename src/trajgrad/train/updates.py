r"""The update steps: one optimizer step each, as a function of the learner state and a batch.

Every step follows the same five lines (§13): zero the gradients; for each micro-batch,
forward, loss with the step's *global* denominator, backward; sum the gradients over ranks
(:func:`trajgrad.distributed.sync_gradients_sum`: the denominators are global counts, so
the sum is the gradient of the whole batch's loss); clip; step. The steps:

* :func:`policy_update`: the recipe's policy loss (:meth:`Objective.policy_loss`), for
  ``epochs_per_batch`` epochs: :func:`old_logprobs` (the log-probs it is taken against),
  :func:`prepare_policy_step` (micro-batches and denominator, inputs checked once), then
  :func:`policy_step` (the loop down to ``optimizer.step()``), the trainer's steps 2, 4, 5;
* :func:`critic_update`: ``K`` value-loss steps on TD(λ) targets, then skip-observation
  GAE advantages from the updated critic (§20.3, §20.4; bootstrap values from
  :mod:`trajgrad.advantages.credit`);
* :func:`distill_update`: on-policy distillation against the frozen teacher (§14).

DPO and SFT, the steps on fixed data, are in :mod:`trajgrad.train.offline`; the metrics
besides the loss in :mod:`trajgrad.train.update_metrics`. Nothing here samples, logs or
checkpoints; the formulas are the core's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..advantages import credit
from .. import distributed as dist_lib
from ..aggregate import Normalizer, masked_mean
from ..diagnostics import explained_variance
from ..turn_stats import mismatch_by_turn
from ..fused import fused_entropy, fused_token_logprobs
from ..losses import kl_estimate
from ..objective import Objective
from ..rollout import RolloutBatch
from ..weights import ReferenceWeights
from ..model.learner import head_inputs, learner_logprobs
from ..model.value_head import ValueHead
from . import fsdp, tokenlog
from ._checkpoint_state import entropy_coef_state, set_entropy_coef_state
from .update_metrics import correction_metrics, sampler_learner_metrics


@dataclass
class LearnerState:
    """What an update step reads and changes: the networks, their optimizers, the settings.

    ``reference`` is None until :func:`snapshot_reference` freezes :math:`\\pi_{ref}`
    (when RL starts), or a :class:`~trajgrad.weights.ReferenceModel` from ``reference.path``;
    ``value_head``/``critic_optimizer`` exist for critic recipes (a
    :class:`~trajgrad.model.value_head.CriticModel` with ``critic.path``),
    ``teacher`` for distillation.
    """

    objective: Objective
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    micro_batch_size: int
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    grad_clip: Optional[float]
    epochs_per_batch: int = 1
    skip_zero_gradient_rows: bool = True
    critic_updates: int = 0
    value_head: Optional[ValueHead] = None
    critic_optimizer: Optional[torch.optim.Optimizer] = None
    reference: Optional[ReferenceWeights] = None
    teacher: Optional[torch.nn.Module] = None

    def trainable(self, model: Optional[torch.nn.Module] = None) -> List[torch.nn.Parameter]:
        return [p for p in (model or self.model).parameters() if p.requires_grad]


# ---------------------------------------------------------------------- shared pieces
def micro_batches(n: int, size: int) -> List[List[int]]:
    """Row indices of consecutive micro-batches of at most ``size`` rows (under FSDP, the same
    number on every rank: :func:`trajgrad.train.fsdp.micro_batch_plan`)."""
    if fsdp.active():
        return fsdp.micro_batch_plan(n, size)
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def forward_only_plan(st: "LearnerState", obj: Objective, advantages: torch.Tensor, mask: torch.Tensor
                      ) -> Tuple[List[List[int]], int]:
    r"""The step's micro-batches and how many of them, first, are differentiated.

    Rows whose loss and gradient are exactly zero (:meth:`Objective.rows_without_gradient`:
    zero advantages under a term that vanishes with them, e.g. a GRPO group with one reward)
    go last, in micro-batches run forward only, without a graph: their log-probs, entropies
    and loss metrics are computed and logged as before, and the backward pass skips them.
    The step's denominator still counts them, so the gradient is the full batch's. Every row
    is differentiated when none, or all, qualify (with none differentiated, the optimizer would
    see no gradient instead of zero ones), under FSDP (every rank runs the same passes), and
    with ``st.skip_zero_gradient_rows`` off.
    """
    n = mask.shape[0]
    free = None
    if st.skip_zero_gradient_rows and not fsdp.active():
        free = obj.rows_without_gradient(advantages, mask)
    if free is None or not bool(free.any()) or bool(free.all()):
        mbs = micro_batches(n, st.micro_batch_size)
        return mbs, len(mbs)
    rows = free.tolist()
    moving = [i for i in range(n) if not rows[i]]
    still = [i for i in range(n) if rows[i]]
    size = st.micro_batch_size
    graded = [moving[i:i + size] for i in range(0, len(moving), size)]
    return graded + [still[i:i + size] for i in range(0, len(still), size)], len(graded)


def in_batch_order(parts: List[torch.Tensor], mbs: List[List[int]]) -> torch.Tensor:
    """Per-micro-batch rows concatenated back into the batch's row order."""
    out = torch.cat(parts, 0)
    order = [i for idx in mbs for i in idx]
    if order == list(range(len(order))):
        return out
    return out[torch.argsort(torch.as_tensor(order, device=out.device))]


def global_denominator(masks, mode: str, constant=None) -> torch.Tensor:
    """The step's denominator: counts summed over micro-batches and ranks (§13); gradients
    are summed over ranks afterwards, so nothing is divided by the world size."""
    norm = Normalizer(mode, constant=constant, grad_average_over_ranks=False)
    for m in masks:
        norm.add(m)
    return norm.denominator()


def finish_step(params, optimizer: torch.optim.Optimizer, grad_clip: Optional[float], *,
                single_process: bool = False) -> Optional[float]:
    """Sum gradients over ranks, clip (returns the pre-clip norm), step. FSDP-sharded
    parameters arrive summed by their reduce-scatter (:mod:`trajgrad.train.fsdp`).
    ``single_process``: the caller knows there is no rank to sum with and no sharded
    parameter; the norm is then clipped by torch directly (the same numbers)."""
    if single_process:
        gn = float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], grad_clip)) \
            if grad_clip else None
    else:
        fsdp.sync_gradients(params)
        gn = fsdp.clip_grad_norm(params, grad_clip) if grad_clip else None
    optimizer.step()
    return gn


class TokenWeightedMetrics:
    """Micro-batch metrics averaged with weights ``tokens(mb) / tokens(batch)``."""

    def __init__(self, total_tokens: float):
        self.total = max(float(total_tokens), 1.0)
        self.values: Dict[str, float] = {}

    def add(self, metrics, tokens: float) -> None:
        w = float(tokens) / self.total
        for k, v in metrics.items():
            if torch.is_tensor(v) and v.numel() == 1 and torch.isfinite(v):
                self.values[k] = self.values.get(k, 0.0) + w * float(v)


def logprobs(st: LearnerState, batch: RolloutBatch, *, model=None, want_hidden=False, want_entropy=False):
    """Learner log-probs of the action tokens under the sampling distribution's transforms."""
    return learner_logprobs(st.model if model is None else model, batch.input_ids, batch.attention_mask,
                            batch.action_mask, temperature=st.temperature, top_k=st.top_k, top_p=st.top_p,
                            want_hidden=want_hidden, want_entropy=want_entropy)


def snapshot_reference(st: LearnerState) -> None:
    """Freeze :math:`\\pi_{ref}` as the current policy (when RL starts; a no-op once taken)."""
    if st.objective.uses_reference and st.reference is None:
        st.reference = ReferenceWeights(st.model)


@torch.no_grad()
def reference_logprobs(st: LearnerState, batch: RolloutBatch) -> torch.Tensor:
    """``[B, L]`` log-probs under :math:`\\pi_{ref}` (snapshotted now if not yet taken)."""
    snapshot_reference(st)
    outs = []
    with st.reference.applied(st.model) as ref:  # the policy with pi_ref's weights, or a separate model
        for idx in micro_batches(len(batch), st.micro_batch_size):
            outs.append(logprobs(st, batch.select(idx), model=ref).logp)
    return torch.cat(outs, 0)


def logprobs_with_entropy(st: LearnerState, batch: RolloutBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""``[B, L]`` float64 log-probs of the action tokens and the per-token entropy
    :math:`\mathcal H_j=-\sum_v\pi_{j,v}\log\pi_{j,v}` of the sampling distribution at
    ``temperature``, *both with their gradient*, from one forward pass.

    Both go through the chunked head of :mod:`trajgrad.fused` (logits recomputed chunk by
    chunk in backward), so ``[B, L, V]`` is never held. The entropy bonus needs the exact
    entropy of the distribution the sampler draws from: with ``top_k``/``top_p`` that is a
    truncated distribution, which this path does not compute, so it raises.
    """
    if st.top_k is not None or (st.top_p is not None and st.top_p < 1.0):
        raise ValueError("entropy_coef: the entropy bonus is computed for sampling without top_k/top_p "
                         f"(got top_k={st.top_k}, top_p={st.top_p})")
    h, w, b = head_inputs(st.model, batch.input_ids, batch.attention_mask)
    mask = batch.action_mask.bool()
    logp = fused_token_logprobs(h, w, batch.input_ids[:, 1:], bias=b, temperature=st.temperature, mask=mask)
    ent = fused_entropy(h, w, bias=b, temperature=st.temperature, mask=mask)
    return logp.double(), ent.double()


def step_objective(st: LearnerState) -> Objective:
    """The recipe of the coming step: with ``entropy_target`` set, ``entropy_coef`` is the
    adaptive coefficient of now (kept with the policy optimizer's state, so a checkpoint
    holds it); otherwise the recipe itself. ``explain(step_objective(st))`` prints the rule
    and the current coefficient."""
    obj = st.objective
    if not obj.adaptive_entropy:
        return obj
    return obj.replace(entropy_coef=entropy_coef_state(st.optimizer, obj.entropy_coef))


def adapt_entropy_coef(st: LearnerState, obj: Objective, entropy_sum: float, tokens: float) -> Dict[str, float]:
    r"""After a step: :math:`\bar{\mathcal H}` = the token mean of the entropy over the step's
    action tokens (sums over ranks), the next coefficient (:meth:`Objective.next_entropy_coef`)
    recorded for the next step, and the metrics ``entropy_control/coef`` (used in this step),
    ``next_coef``, ``target`` and ``measured``."""
    total, count = dist_lib.sum_over_ranks(entropy_sum), dist_lib.sum_over_ranks(tokens)
    measured = total / count if count > 0 else obj.entropy_target  # no token: no evidence, c unchanged
    nxt = obj.next_entropy_coef(measured) if count > 0 else obj.entropy_coef
    set_entropy_coef_state(st.optimizer, nxt)
    return {"entropy_control/coef": obj.entropy_coef, "entropy_control/next_coef": nxt,
            "entropy_control/target": float(obj.entropy_target), "entropy_control/measured": float(measured)}


# ---------------------------------------------------------------------- policy
@dataclass
class StepLogprobs:
    """The log-probs a policy update is taken against (:func:`old_logprobs`), ``[B, L]`` float64.

    ``behaviour``: the sampler's raw records (§7); ``behaviour_logp``: the same, 0 off the
    action tokens; ``old``: the ratio's old log-probs (the recomputed ones, or the sampler's
    with ``train.old_logp: behaviour``), None when the update's own detached forward pass is
    the old one (one on-policy epoch); ``recomputed``: the no-grad pass under the current
    weights (None when skipped); ``hidden``: its last hidden states (critic recipes);
    ``reference``: :math:`\\log\\pi_{ref}` (None without a KL term).
    """

    behaviour: torch.Tensor
    behaviour_logp: torch.Tensor
    old: Optional[torch.Tensor]
    recomputed: Optional[torch.Tensor]
    hidden: Optional[torch.Tensor]
    reference: Optional[torch.Tensor]


def old_logprobs(st: LearnerState, batch: RolloutBatch, mode: str, metrics: Dict[str, float]) -> StepLogprobs:
    """The log-probs under the current (= old) weights, the sampler's and the reference's.

    ``mode`` is ``train.old_logp``. ``"auto"`` with a single on-policy epoch needs no separate
    pass: the update's own forward pass, detached, IS the recomputed log-prob under the
    current (= old) weights (ratio 1 exactly); otherwise one no-grad pass per micro-batch
    gives them, with the entropy and learner-vs-sampler metrics (§7). The term takes its ratio
    against the log-probs it declares (:attr:`Objective.ratio_source`): the recomputed ones
    (``"old"``), or the sampler's (``"behaviour"``, §20.2). Logs ``kl/k3_to_reference`` and
    ``time/logprob_recompute`` into ``metrics``.
    """
    obj = st.objective
    t0 = time.perf_counter()
    mask = batch.action_mask
    behaviour = batch.old_logp.double()
    fused_old = (mode == "auto" and st.epochs_per_batch == 1 and not obj.critic
                 and obj.ratio_source != "behaviour" and obj.kl_placement != "reward")
    recomputed = hidden = None
    if not fused_old:
        with torch.no_grad():
            outs = [logprobs(st, batch.select(i), want_hidden=obj.critic, want_entropy=True)
                    for i in micro_batches(len(batch), st.micro_batch_size)]
            recomputed = torch.cat([o.logp for o in outs], 0).double()
            hidden = torch.cat([o.hidden for o in outs], 0) if obj.critic else None
            entropy = torch.cat([o.entropy for o in outs], 0)
        metrics.update(sampler_learner_metrics(recomputed, behaviour, entropy, mask))
    behaviour_logp = torch.where(mask, behaviour, 0.0)
    old = behaviour_logp if mode == "behaviour" else (None if fused_old else recomputed)
    ref_logp = reference_logprobs(st, batch).double() if obj.kl_placement != "none" else None
    if ref_logp is not None and recomputed is not None:
        metrics["kl/k3_to_reference"] = float(masked_mean(kl_estimate(recomputed, ref_logp, mask, kind="k3"), mask))
    metrics["time/logprob_recompute"] = time.perf_counter() - t0
    return StepLogprobs(behaviour, behaviour_logp, old, recomputed, hidden, ref_logp)


@dataclass
class PolicyStep:
    """Everything one policy update reads, prepared by :func:`prepare_policy_step`.

    ``objective``: the step's recipe (:func:`step_objective`); ``rows`` / ``micro``: each
    micro-batch's row indices and the micro-batch itself, the first ``n_graded`` of them
    differentiated (:func:`forward_only_plan`); ``denominator``: the step's global one (§13);
    ``single_process``: no rank to sum gradients with and no sharded parameter
    (:func:`finish_step`); ``record``: the per-token record (:mod:`trajgrad.train.tokenlog`)
    or None; ``started``: when the update began (``time/update`` counts from here).
    """

    objective: Objective
    batch: RolloutBatch
    advantages: torch.Tensor
    old_logp: Optional[torch.Tensor]
    ref_logp: Optional[torch.Tensor]
    behaviour: Optional[torch.Tensor]
    behaviour_logp: Optional[torch.Tensor]
    rows: List[List[int]]
    micro: List[RolloutBatch]
    n_graded: int
    denominator: torch.Tensor
    adaptive: bool
    single_process: bool
    record: Optional[tokenlog.StepRecord]
    started: float
    cost_advantages: Optional[torch.Tensor] = None  # for a term that reads them (§22), else None


def prepare_policy_step(st: LearnerState, batch: RolloutBatch, advantages: torch.Tensor,
                        old_logp: Optional[torch.Tensor], ref_logp: Optional[torch.Tensor], *,
                        behaviour: Optional[torch.Tensor] = None, behaviour_logp: Optional[torch.Tensor] = None,
                        record: Optional[tokenlog.StepRecord] = None, cost_advantages: Optional[torch.Tensor] = None,
                        lagrange=None) -> PolicyStep:
    """Check the step's inputs once and lay it out: the step's recipe, its micro-batches (rows
    with zero loss and gradient last, forward only), its global denominator (§13). The
    arguments are those of :func:`policy_update`; ``cost_advantages`` and ``lagrange`` (a
    :class:`~trajgrad.control.LagrangeMultiplier`, whose current λ the step's recipe takes) for a
    term that reads cost advantages (§22)."""
    started = time.perf_counter()
    obj = step_objective(st)
    if lagrange is not None:
        obj = lagrange.bind(obj)
    mask = batch.action_mask
    if old_logp is None and st.epochs_per_batch != 1:
        raise ValueError("old_logp: required when epochs_per_batch > 1")
    adaptive = obj.adaptive_entropy
    if adaptive and (st.top_k is not None or (st.top_p is not None and st.top_p < 1.0)):
        raise ValueError("entropy_target: the entropy is measured for sampling without top_k/top_p "
                         f"(got top_k={st.top_k}, top_p={st.top_p})")
    mbs, n_graded = forward_only_plan(st, obj, advantages, mask)
    den = global_denominator([mask[i] for i in mbs], obj.aggregation, constant=obj.constant)
    if obj.rollout_correction and behaviour_logp is None:
        raise ValueError("behaviour_logp: required by rollout_correction (the log-probs recorded at sampling)")
    return PolicyStep(obj, batch, advantages, old_logp, ref_logp, behaviour, behaviour_logp, mbs,
                      [batch.select(idx) for idx in mbs], n_graded, den, adaptive,
                      not (dist_lib.is_distributed() or fsdp.active()), record, started, cost_advantages)


def policy_step(st: LearnerState, step: PolicyStep) -> Dict[str, float]:
    """``epochs_per_batch`` optimizer steps of the recipe's policy loss (see :func:`policy_update`).

    For each epoch: zero the gradients; for each micro-batch, the log-probs (with the entropy
    when the loss or the record needs it), the loss with the step's global denominator,
    backward (forward only for the rows without gradient); then one optimizer step. The
    per-token record of each micro-batch is taken after the step (the step leaves the
    log-probs' gradients as they are).
    """
    obj, batch, advantages = step.objective, step.batch, step.advantages
    old_logp, ref_logp, behaviour_logp = step.old_logp, step.ref_logp, step.behaviour_logp
    mask, mbs, rec, adaptive = batch.action_mask, step.rows, step.record, step.adaptive
    params = st.trainable()
    with_entropy = obj.entropy_coef > 0
    ent_sum = 0.0  # the first epoch's entropy over the action tokens (adaptive entropy control)
    seen_logp, seen_ent, first_logp = [], [], []
    acc = TokenWeightedMetrics(mask.sum() * st.epochs_per_batch)  # a mean over micro-batches and epochs
    loss_total, grad_norm = 0.0, None
    for _epoch in range(st.epochs_per_batch):
        st.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        recorded = []
        for k, (idx, mb) in enumerate(zip(mbs, step.micro)):
            first = old_logp is None
            graded = k < step.n_graded  # the rest are rows with zero loss and gradient: forward only
            with torch.set_grad_enabled(graded and torch.is_grad_enabled()):
                if with_entropy:
                    lp, ent = logprobs_with_entropy(st, mb)
                else:
                    out = logprobs(st, mb, want_entropy=first or rec is not None or (adaptive and _epoch == 0))
                    lp, ent = out.logp.double(), out.entropy
            if adaptive and _epoch == 0:
                ent_sum += float(torch.where(mb.action_mask.bool(), ent.detach().double(), 0.0).sum())
            if first:
                seen_logp.append(lp.detach())
                seen_ent.append(ent.detach())
            if _epoch == 0:
                first_logp.append(lp.detach())
            old_mb = lp.detach() if old_logp is None else old_logp[idx]
            beh_mb = None if behaviour_logp is None else behaviour_logp[idx]
            cost_mb = None if step.cost_advantages is None else step.cost_advantages[idx]
            with torch.set_grad_enabled(graded and torch.is_grad_enabled()):
                res = obj.policy_loss(lp, advantages[idx], mb.action_mask, old_logp=old_mb, behaviour_logp=beh_mb,
                                      ref_logp=None if ref_logp is None else ref_logp[idx],
                                      entropy=ent if with_entropy else None, denominator=step.denominator,
                                      cost_advantages=cost_mb)
            if rec is not None and lp.requires_grad:
                lp.retain_grad()
            if graded:
                res.loss.backward()
            if rec is not None:
                recorded.append((mb, idx, lp, ent, advantages[idx], old_mb, beh_mb))
            loss_total += float(res.loss.detach())
            acc.add(res.metrics, mb.action_mask.sum())
        grad_norm = finish_step(params, st.optimizer, st.grad_clip, single_process=step.single_process)
        for mb, idx, lp, ent, adv_mb, old_mb, beh_mb in recorded:
            rec.add(obj, mb, idx, lp, ent, adv_mb, old_mb, beh_mb, epoch=_epoch)
        if grad_norm is not None:
            acc.values["grad_norm"] = grad_norm
    metrics = acc.values
    metrics["loss"] = loss_total
    metrics["update/forward_only_frac"] = sum(len(i) for i in mbs[step.n_graded:]) / max(len(batch), 1)
    if adaptive:
        metrics.update(adapt_entropy_coef(st, obj, ent_sum, float(mask.sum())))
    rc = obj.rollout_correction
    if rc:
        # the targets the correction used: pi_old (fixed over the epochs) or the first epoch's pi_theta
        target = old_logp if (old_logp is not None and rc.mode == "decoupled") else in_batch_order(first_logp, mbs)
        metrics.update(correction_metrics(obj, batch, behaviour_logp, target, advantages,
                                          current_logp=in_batch_order(first_logp, mbs)))
    behaviour = step.behaviour
    if behaviour is not None and first_logp:
        # the first epoch's log-probs are those of the weights before the step (pi_old)
        metrics.update(mismatch_by_turn(in_batch_order(first_logp, mbs), behaviour, mask, batch.turn_ids))
    if seen_logp and behaviour is not None:
        metrics.update(sampler_learner_metrics(in_batch_order(seen_logp, mbs), behaviour,
                                               in_batch_order(seen_ent, mbs), mask))
    return metrics


def policy_update(st: LearnerState, batch: RolloutBatch, advantages: torch.Tensor, old_logp: Optional[torch.Tensor],
                  ref_logp: Optional[torch.Tensor], *, behaviour: Optional[torch.Tensor] = None,
                  behaviour_logp: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """``epochs_per_batch`` optimizer steps of the recipe's policy loss on one batch
    (:func:`prepare_policy_step`, then :func:`policy_step`; recorded into the token log of
    :func:`trajgrad.train.tokenlog.recording` when one is open).

    ``old_logp=None``: one on-policy epoch; each micro-batch's own detached log-probs are
    the old log-probs (the numbers a separate no-grad pass would give, ratio 1 exactly).
    ``behaviour_logp``: the sampler's log-probs (0 off the action tokens), handed to
    :meth:`Objective.policy_loss` with ``old_logp``; the term takes its ratio against the one
    it declares (§7, §20.2). ``behaviour``: the sampler's raw records, for the
    learner-vs-sampler metrics. With ``entropy_coef > 0`` the loss gets the per-token entropy
    of the sampling distribution with its gradient (:func:`logprobs_with_entropy`). With
    ``entropy_target`` set, the step uses the current adaptive coefficient
    (:func:`step_objective`) and sets the next one from the entropy measured in its first
    epoch (:func:`adapt_entropy_coef`).

    With ``rollout_correction`` set, every micro-batch's loss is corrected with the three
    sources: ``behaviour_logp`` (required), the old log-probs (``old_logp``, or with
    ``old_logp=None`` the micro-batch's own detached log-probs, equal to the old ones in the
    single epoch) and the current ones. The ``correction/*`` metrics reported are those of
    the whole batch in the first epoch (:func:`correction_metrics`, per turn too). With
    ``behaviour`` given, ``mismatch/turn{k}/kl_k1|kl_k3`` are the sampler–learner mismatch
    per turn, from the first epoch's log-probs (the weights that sampled, in the synchronous
    loop), logged with the correction off too. Metrics of the loss are means over the epochs.

    Rows with zero loss and gradient (zero advantages under a term that vanishes with them;
    :func:`forward_only_plan`) run last and forward only: the same parameter update, metrics
    and per-token log, without their backward pass. ``update/forward_only_frac`` is the
    fraction of rows run so.
    """
    return policy_step(st, prepare_policy_step(st, batch, advantages, old_logp, ref_logp, behaviour=behaviour,
                                               behaviour_logp=behaviour_logp, record=tokenlog.active()))


# ---------------------------------------------------------------------- critic
def critic_update(st: LearnerState, batch: RolloutBatch, hidden: torch.Tensor,
                  token_rewards: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, float]]:
    """``K`` critic steps on TD(λ) targets, then advantages from the updated critic (§20.3).

    Targets and advantages are skip-observation GAE (§20.4) with each row's terminal mask
    and bootstrap value from :mod:`trajgrad.advantages.credit` (a compacted sub-trace bootstraps from
    its next sub-trace, §19). Returns ``([B, L] advantages, metrics)``.
    """
    obj = st.objective
    mask = batch.action_mask
    term = batch.terminated
    terminated = credit.terminal_token_mask(mask, term)
    next_rows = batch.next_segment_rows()
    if getattr(st.value_head, "reads_tokens", False):  # a critic with its own backbone (critic.path)
        hidden = batch
    with torch.no_grad():
        values = st.value_head(hidden).double()
    boot = credit.bootstrap_values(values, mask, term, next_rows)
    targets = obj.token_advantages(values, token_rewards, mask, terminated=terminated, bootstrap_value=boot).returns
    vden = global_denominator([mask], "token_mean")
    vl = None
    for _ in range(st.critic_updates):
        st.critic_optimizer.zero_grad(set_to_none=True)
        pred = st.value_head(hidden).double()
        vl = obj.value_loss(pred, targets, mask, old_values=values, denominator=vden)
        vl.loss.backward()
        finish_step(list(st.value_head.parameters()), st.critic_optimizer, None)
    with torch.no_grad():
        new_values = st.value_head(hidden).double()
    # the advantages use the updated critic throughout, its bootstrap included
    boot2 = credit.bootstrap_values(new_values, mask, term, next_rows)
    adv = obj.token_advantages(new_values, token_rewards, mask, terminated=terminated, bootstrap_value=boot2).advantages
    m = {"critic/value_loss": float(vl.loss.detach()) if vl is not None else float("nan"),
         "critic/explained_variance": float(explained_variance(targets, values, mask)),
         "critic/value_mean": float(masked_mean(values, mask))}
    return adv, m


# ---------------------------------------------------------------------- distillation
def distill_update(st: LearnerState, batch: RolloutBatch) -> Dict[str, float]:
    """One step of on-policy distillation: the student's samples, the teacher's full
    distribution through the fused head (§14)."""
    obj = st.objective
    mbs = micro_batches(len(batch), st.micro_batch_size)
    den = global_denominator([batch.action_mask[i] for i in mbs], obj.aggregation, constant=obj.constant)
    st.optimizer.zero_grad(set_to_none=True)
    acc = TokenWeightedMetrics(batch.action_mask.sum())
    total = 0.0
    for idx in mbs:
        mb = batch.select(idx)
        h, w, b = head_inputs(st.model, mb.input_ids, mb.attention_mask)
        with torch.no_grad():
            th, tw, tb = head_inputs(st.teacher, mb.input_ids, mb.attention_mask)
        res = obj.distill_loss(student_hidden=h, student_weight=w, student_bias=b, teacher_hidden=th,
                               teacher_weight=tw, teacher_bias=tb, mask=mb.action_mask, denominator=den,
                               temperature=st.temperature)
        res.loss.backward()
        total += float(res.loss.detach())
        acc.add(res.metrics, mb.action_mask.sum())
    gn = finish_step(st.trainable(), st.optimizer, st.grad_clip)
    metrics = acc.values
    if gn is not None:
        metrics["grad_norm"] = gn
    metrics["loss"] = total
    return metrics
