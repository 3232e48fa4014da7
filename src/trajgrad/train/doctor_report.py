r"""The doctor's verdict, its thresholds, and advice drawn from what it measured.

Verdicts (printed with their thresholds):

* group recipes: ``no signal`` when every sampled group has equal rewards (all advantages are
  0: no policy gradient at all), ``weak signal`` when at least :data:`WEAK_GROUPS` of them do,
  else ``ok``;
* single-rollout and critic recipes: ``no signal`` when every episode has the same reward
  (variance 0), else ``ok``;
* distillation and preference recipes: ``n/a`` (they take no reward signal).

With per-episode success probability :math:`p`, a group of :math:`G` has mixed outcomes with
probability :math:`1 - p^G - (1-p)^G`; the advice quotes it at the upper end of the success
rate's interval, and the group size at which half the groups would be mixed.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .doctor import SFT_SHARE

WEAK_GROUPS = 0.75      # fraction of zero-variance groups from which the signal is called weak
HIGH_CUT = 0.2          # fraction of turns cut at max_new_tokens worth a warning
HIGH_TOOL_ERRORS = 0.5  # fraction of turns with a malformed or failed action
HIGH_INVALID = 0.2      # fraction of actions the environment refused
HIGH_TURN_LIMIT = 0.5   # fraction of episodes that ran out of turns


def thresholds(kind: Optional[str]) -> str:
    if kind == "group":
        return (f"no signal = every group has equal rewards; weak signal = at least {WEAK_GROUPS:.0%} of the groups "
                "do; ok = otherwise")
    if kind == "batch":
        return "no signal = every episode has the same reward (variance 0); ok = otherwise"
    return "n/a: the recipe takes no reward signal"


def verdict(f: Dict[str, Any]) -> str:
    kind = f["signal_kind"]
    if kind == "group":
        zv = f["zero_variance_groups"]
        if zv["n"] == 0 or zv["k"] == zv["n"]:
            return "no signal"
        return "weak signal" if zv["p"] >= WEAK_GROUPS else "ok"
    if kind == "batch":
        return "ok" if f.get("reward_var", 0.0) > 0 else "no signal"
    return "n/a"


def mixed_probability(p: float, G: int) -> float:
    """Probability that a group of ``G`` independent episodes of success ``p`` has both outcomes."""
    return 1.0 - p ** G - (1.0 - p) ** G


def _group_needed(p: float, target: float = 0.5, limit: int = 256) -> Optional[int]:
    for G in range(2, limit + 1):
        if mixed_probability(p, G) >= target:
            return G
    return None


def advice(f: Dict[str, Any]) -> List[str]:
    """Concrete options, each from a measured fact."""
    out: List[str] = []
    v, G, s = verdict(f), f["group_size"], f["success"]
    done, planned = f.get("sft_steps", 0), f.get("sft_configured", 0)
    if done < planned:
        need = f["seconds"] + f.get("sft_seconds", 0.0) / max(done, 1) * (planned - done) / SFT_SHARE
        out.append(f"the policy sampled had {done} of the run's {planned} SFT warm-start steps (the time budget "
                   f"ran out): this verdict is about a less trained policy than the run's; for the run's own, "
                   f"--max-seconds {need:.0f} (estimated from the steps' time)")
    if v in ("no signal", "weak signal"):
        if f["signal_kind"] == "group":
            zv = f["zero_variance_groups"]
            head = (f"{zv['k']} of {zv['n']} groups have equal rewards: with group size {G} and base success "
                    f"{s['p']:.0%} (95% CI {s['low']:.1%} to {s['high']:.1%}) ")
            head += f"there is no {f['recipe'].upper()} gradient" if v == "no signal" else "most groups give no gradient"
        else:
            head = "every episode has the same reward: nothing tells a better episode from a worse one"
        options = []
        if s["p"] == 0 or s["p"] == 1:
            options.append("an SFT warm start from demonstrations (sft.steps" +
                           (", the task has demonstrations)" if f.get("has_demos") else "; the task needs "
                            "demonstrations)"))
        if f["signal_kind"] == "group" and s["high"] > 0:
            need = _group_needed(s["high"] if s["p"] == 0 else s["p"])
            if need is not None and need > G:
                options.append(f"a larger group (train.group_size {need}: half the groups mixed at success "
                               f"{(s['high'] if s['p'] == 0 else s['p']):.1%})")
        elif f["signal_kind"] == "group":
            options.append(f"a larger group (train.group_size > {G})")
        if f["reward"]["min"] == f["reward"]["max"]:
            options.append("a partial-credit reward (every episode scored the same: "
                           f"{f['reward']['min']:g}; e.g. credit for a well-formed tool call or a close answer)")
        if f["signal_kind"] == "group":
            options.append("dynamic sampling (recipe dapo, or recipe.overrides.dynamic_sampling: true: groups with "
                           "equal rewards are resampled)")
        if s["p"] == 1:
            options.append("harder tasks: every episode already succeeds")
        out.append(head + "; options: " + ", ".join(options))
    cut = f["cut_turns"]
    if cut["n"] and cut["p"] >= HIGH_CUT:
        out.append(f"{cut['p']:.0%} of turns stop at sampling.max_new_tokens ({f['max_new_tokens']}): raise it, or "
                   "the actions are cut before they end")
    te = f["tool_errors"]
    if te["n"] and te["p"] >= HIGH_TOOL_ERRORS:
        top = "; ".join(f"{msg[:60]!r} x{c}" for msg, c in te["top"])
        out.append(f"{te['p']:.0%} of turns have a malformed or failed action ({top}): a few-shot example, a "
                   "system prompt that shows the format, or an SFT warm start")
    inv = f.get("invalid_actions")
    if inv and inv["n"] and inv["p"] >= HIGH_INVALID:
        out.append(f"the environment refused {inv['p']:.0%} of the actions: check what it accepts")
    tl = f["turn_limit"]
    if tl["n"] and tl["p"] >= HIGH_TURN_LIMIT:
        out.append(f"{tl['p']:.0%} of episodes were truncated (turn limit): more turns (max_turns), or the policy "
                   "never ends")
    tm = f["template_mismatch"]
    if tm["k"]:
        out.append(f"{tm['k']} episodes ended at a chat-template mismatch (never trained): see "
                   "rollout.template_mismatch")
    return out


def _p(d: Dict[str, float]) -> str:
    return f"{d['k']}/{d['n']} = {d['p']:.1%} (95% CI {d['low']:.1%} to {d['high']:.1%})"


def _m(d: Dict[str, float]) -> str:
    return f"{d['mean']:.3g} (95% CI {d['low']:.3g} to {d['high']:.3g})"


def format_report(f: Dict[str, Any]) -> Tuple[str, str]:
    """(report text, verdict)."""
    v = verdict(f)
    sft = f" after the SFT warm start ({f['sft_steps']} steps, as the run)" if f.get("sft_steps") else ""
    if f.get("sft_steps", 0) < f.get("sft_configured", 0):
        sft = (f" after {f['sft_steps']} of the {f['sft_configured']} SFT warm-start steps (stopped at the time "
               "budget: the run's policy is trained further; --max-seconds gives more time)")
    r = f["reward"]
    values = ", ".join(f"{val:g} x{c}" for val, c in r["values"])
    lines = [f"trajgrad doctor: recipe {f['recipe']!r}, model {f['model']}{sft}, temperature {f['temperature']:g}, "
             f"group size {f['group_size']}",
             f"sampled {f['groups']} of {f['groups_asked']} groups ({f['episodes']} episodes) in "
             f"{f['seconds']:.0f} s (budget {f['budget_s']:.0f} s; a batch already started is finished)", "",
             f"reward                {_m(r)}; min {r['min']:g}, max {r['max']:g}; most common: {values}",
             f"success               {_p(f['success'])}",
             f"action errors         {_p(f['tool_errors'])} of turns (tool_error: malformed or failed tool call, no action)",
             "env-invalid actions   " + (f"{_p(f['invalid_actions'])} of turns" if f.get("invalid_actions")
                                        else "not reported by this environment"),
             f"cut at max_new_tokens {_p(f['cut_turns'])} of turns (limit {f['max_new_tokens']})",
             f"truncated episodes    {_p(f['turn_limit'])} (turn or context limit)",
             f"template mismatches   {_p(f['template_mismatch'])} of episodes",
             f"turns per episode     {_m(f['turns'])}",
             f"tokens per episode    {_m(f['action_tokens'])}"]
    if "zero_variance_groups" in f:
        lines.append(f"groups without signal {_p(f['zero_variance_groups'])} (equal rewards in the group of "
                     f"{f['group_size']})")
    if "reward_var" in f:
        lines.append(f"reward variance       {f['reward_var']:.4g} over the batch")
    lines += ["", f"verdict: {v.upper()}", f"  thresholds: {thresholds(f['signal_kind'])}"]
    tips = advice(f)
    if tips:
        lines += ["advice:"] + [f"  - {t}" for t in tips]
    return "\n".join(lines), v
