"""The CUDA part of bench/gpu/check.sh: trajgrad's sampler and learner on a CUDA GPU.

1. Sampler vs learner: ``HFSampler`` rolls out calculator episodes with a SmolLM2-shaped random
   model (float32 and bfloat16); the learner recomputes every action token's log-prob
   (``trajgrad.logprobs.token_logprobs`` at T=0.7, top-p 0.9): max |difference| is printed.
2. The main job's update step timed: LoRA r=8 on that model, 32 sequences (8 prompts x 4
   samples) of ``--length`` tokens, forward + backward of the fused action-token log-probs,
   optimizer step; median of ``--repeats`` after one warm-up.
3. Fused log-prob kernel memory: peak CUDA memory of ``fused_token_logprobs`` (forward +
   backward) against ``log_softmax`` over materialized ``[B, L, V]`` logits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

DEVICE = "cuda"  # --device cpu: a smoke test of this script's code paths without a GPU


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def smollm2_shaped(dtype, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from trajgrad.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype=dtype, device=DEVICE).eval()
    return model, tok


def agreement(dtype):
    from trajgrad.envs import get_task_source
    from trajgrad.logprobs import token_logprobs
    from trajgrad.model.tiny import build_tiny_model
    from trajgrad.model.tokenizer import build_char_tokenizer
    from trajgrad.rollout import HFSampler

    tok = build_char_tokenizer()  # a vocabulary the character tokenizer covers
    model = build_tiny_model(tok, hidden_size=256, layers=4, heads=4, seed=0).to(dtype=dtype, device=DEVICE).eval()
    source = get_task_source("calculator", max_turns=2)
    sampler = HFSampler(model, tok, temperature=0.7, top_p=0.9, max_new_tokens=32)
    trajs = sampler.rollout(source, source.tasks("train", 8, 0), group_size=4, seed=0)
    worst, n = 0.0, 0
    for t in trajs:
        ids = torch.tensor([t.token_ids()], device=DEVICE)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        lp = token_logprobs(logits, ids[0, 1:], temperature=0.7, top_p=0.9).cpu()
        mask = torch.tensor(t.action_mask(), dtype=torch.bool)
        old = torch.tensor(t.behaviour_logp_aligned())
        worst = max(worst, float((lp[mask] - old[mask]).abs().max()))
        n += int(mask.sum())
    return worst, n


def update_step(length, repeats):
    from peft import LoraConfig, get_peft_model

    from trajgrad.fused import fused_token_logprobs

    model, _ = smollm2_shaped(torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, 49152, (32, length), generator=g).to(DEVICE)
    mask = torch.zeros(32, length - 1, dtype=torch.bool, device=DEVICE)
    mask[:, length // 2:] = True
    head = model.get_output_embeddings().weight
    times = []
    for i in range(repeats + 1):
        _sync()
        t0 = time.perf_counter()
        for mb in range(0, 32, 8):  # micro-batches of 8, as the preset
            hidden = model(input_ids=ids[mb:mb + 8], output_hidden_states=True).hidden_states[-1][:, :-1]
            lp = fused_token_logprobs(hidden, head, ids[mb:mb + 8, 1:], temperature=0.7, mask=mask[mb:mb + 8])
            loss = -(lp * mask[mb:mb + 8]).sum() / mask.sum()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), (torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else float("nan"))


def kernel_memory(rows, vocab=49152, hidden=576):
    from trajgrad.fused import fused_token_logprobs

    out = {}
    for name in ("fused", "materialized"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        h = torch.randn(rows, hidden, device=DEVICE, requires_grad=True)
        w = torch.randn(vocab, hidden, device=DEVICE, requires_grad=True) * 0.02
        w.retain_grad()
        y = torch.randint(0, vocab, (rows,), device=DEVICE)
        base = torch.cuda.memory_allocated()
        if name == "fused":
            lp = fused_token_logprobs(h, w, y)
        else:
            lp = torch.log_softmax(h @ w.t(), dim=-1).gather(-1, y[:, None])[:, 0]
        lp.sum().backward()
        _sync()
        out[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del h, w, y, lp
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        worst, n = agreement(torch.float32)
        t, _ = update_step(args.length, args.repeats)
        print(f"cpu smoke test: agreement {worst:.2e} over {n} tokens; update step {t:.2f} s")
        return 0
    if not torch.cuda.is_available():
        print("SKIPPED: torch.cuda.is_available() is False")
        return 1
    print(f"# trajgrad on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    for dtype in (torch.float32, torch.bfloat16):
        worst, n = agreement(dtype)
        print(f"sampler vs learner, {dtype}: max |log-prob difference| {worst:.2e} over {n} action tokens")
    t, peak = update_step(args.length, args.repeats)
    print(f"update step (SmolLM2 shape, LoRA r=8, 32 x {args.length} tokens, micro-batch 8): median {t:.3f} s, "
          f"peak {peak:.0f} MiB")
    mem = kernel_memory(32 * args.length)
    print(f"log-probs of {32 * args.length} rows x 49152 vocab, forward + backward: fused {mem['fused']:.0f} MiB, "
          f"materialized logits {mem['materialized']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
