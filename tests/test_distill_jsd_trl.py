"""JSD(beta) in TRL's convention (``normalized="kl_at_ends"``): value and gradient against a
hand-written form of TRL's ``generalized_jsd_loss`` (GKD trainer) at beta in {0, 0.5, 1}."""
from __future__ import annotations

import math

import pytest
import torch

from trajgrad.losses import jsd_distill_loss

F64 = torch.float64


def trl_generalized_jsd(student_logits, teacher_logits, labels, beta, temperature):
    """TRL's definition, written out: log-softmax of logits / T for both; beta = 0 is
    KL(teacher || student), beta = 1 is KL(student || teacher); otherwise the mixture
    m = beta * p_teacher + (1 - beta) * p_student and beta * KL(p_t || m) + (1 - beta) * KL(p_s || m);
    elementwise terms summed over the vocabulary and the valid tokens (labels != -100), divided
    by the number of valid tokens ("batchmean" with labels)."""
    ls = torch.log_softmax(student_logits / temperature, -1)
    lt = torch.log_softmax(teacher_logits / temperature, -1)
    if beta == 0:
        per = lt.exp() * (lt - ls)
    elif beta == 1:
        per = ls.exp() * (ls - lt)
    else:
        lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), dim=0)
        per = beta * lt.exp() * (lt - lm) + (1 - beta) * ls.exp() * (ls - lm)
    valid = labels != -100
    return per[valid].sum() / valid.sum()


def make(seed, B=3, L=6, V=11, H=5):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, L, H, generator=g, dtype=F64)
    ws = torch.randn(V, H, generator=g, dtype=F64)
    zt = torch.randn(B, L, V, generator=g, dtype=F64) * 2
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[torch.rand(B, L, generator=g) < 0.3] = -100
    labels[0, 0] = 3
    return hs, ws, zt, labels


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2, 0.9])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_kl_at_ends_matches_trl_value_and_gradient(beta, temperature, path):
    hs, ws, zt, labels = make(int(beta * 10) + int(temperature * 10))
    mask = labels != -100
    h1, h2 = hs.clone().requires_grad_(), hs.clone().requires_grad_()
    if path == "logits":
        ours = jsd_distill_loss(student_logits=h1 @ ws.T, teacher_logits=zt, mask=mask, beta=beta,
                                normalized="kl_at_ends", temperature=temperature, chunk_size=4)
    else:
        ours = jsd_distill_loss(student_hidden=h1, student_weight=ws, teacher_logits=zt, mask=mask, beta=beta,
                                normalized="kl_at_ends", temperature=temperature, chunk_size=4)
    ref = trl_generalized_jsd(h2 @ ws.T, zt, labels, beta, temperature)
    assert torch.allclose(ours.loss, ref, atol=1e-13, rtol=1e-11), (ours.loss, ref)
    (g1,) = torch.autograd.grad(ours.loss, [h1])
    (g2,) = torch.autograd.grad(ref, [h2])
    assert torch.allclose(g1, g2, atol=1e-13, rtol=1e-10)


def test_kl_at_ends_is_the_kl_at_the_ends_and_unnormalized_inside():
    hs, ws, zt, labels = make(3)
    zs, mask = hs @ ws.T, labels != -100
    kw = dict(student_logits=zs, teacher_logits=zt, mask=mask)
    trl = {b: jsd_distill_loss(**kw, beta=b, normalized="kl_at_ends").loss for b in (0.0, 0.5, 1.0)}
    from trajgrad.losses import forward_kl_distill_loss, reverse_kl_distill_loss

    assert torch.equal(trl[0.0], forward_kl_distill_loss(**kw).loss)
    assert torch.equal(trl[1.0], reverse_kl_distill_loss(**kw).loss)
    assert torch.equal(trl[0.5], jsd_distill_loss(**kw, beta=0.5, normalized=False).loss)
    assert torch.allclose(4 * trl[0.5], jsd_distill_loss(**kw, beta=0.5).loss, atol=1e-14)
    # the default (normalized) differs from TRL inside (0, 1): a factor 1 / (beta (1 - beta))
    assert not torch.allclose(jsd_distill_loss(**kw, beta=0.5).loss, trl[0.5])


def test_normalized_rejects_unknown_values():
    hs, ws, zt, labels = make(4)
    for bad in ("trl", "yes", 2, 0.5):
        with pytest.raises(ValueError, match="normalized"):
            jsd_distill_loss(student_logits=hs @ ws.T, teacher_logits=zt, mask=labels != -100, normalized=bad)
