"""Top-p log-probs read from the full softmax, without renormalizing over the kept tokens (§7).

The sampler draws from q(v) = p(v) / S over the nucleus (S = the kept mass). Taking log p(v)
from the full softmax gives log q − log S at every token: the importance ratio against a
correctly recorded behaviour log-prob is off by the factor S everywhere. Public record:
huggingface/trl issue #6789 (vLLM's processed log-probs are renormalized over the truncated
support while the trainer recomputes a full-vocabulary log-softmax; the ratio is scaled by S).

    trajgrad verify examples/bugs/topp_unnormalized.py:logprobs --as logprobs   # fails value, normalized
"""
import torch


def logprobs(logits, targets, *, temperature=1.0, top_k=None, top_p=None):
    z = logits / temperature
    full = torch.log_softmax(z, -1)
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None:
        kth = torch.topk(z, top_k, -1).values[..., -1:]
        keep &= z >= kth
    if top_p is not None:
        probs = torch.softmax(torch.where(keep, z, -torch.inf), -1)
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = before < top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    lp = full.gather(-1, targets[..., None]).squeeze(-1)       # BUG: not renormalized over `keep`
    inside = keep.gather(-1, targets[..., None]).squeeze(-1)
    return torch.where(inside, lp, torch.full_like(lp, -torch.inf))
