"""The core's packages and the public names that must keep working across the move.

Kept paths import without a warning; a moved module's old path (``trajgrad._moved.MOVED``)
imports for one release with a ``DeprecationWarning`` naming the new path, as the very module
of the new path. No module of the project imports an old path.
"""
import ast
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import trajgrad
from trajgrad import _moved

ROOT = Path(trajgrad.__file__).parent
REPO = ROOT.parent.parent

# The public names the project builds on (DESIGN.md) and the README's estimator table.
PUBLIC = {
    "trajgrad.logprobs": ["token_logprobs", "entropy", "fused_token_logprobs", "sampling_logits", "fused_entropy"],
    "trajgrad.returns": ["discounted_return", "reward_to_go", "gae", "skip_observation_gae",
                         "token_skip_observation_gae", "n_step_advantage", "shape_rewards"],
    "trajgrad.baselines": ["group_advantages", "leave_one_out", "broadcast_to_tokens", "whiten"],
    "trajgrad.ratios": ["token_log_ratio", "sequence_log_ratio", "gspo_sequence_ratio", "gspo_token_ratio",
                        "segment_log_ratios"],
    "trajgrad.advantages": ["reinforce_pp_advantages", "reinforce_pp_token_advantages", "maxrl_advantages",
                            "gdpo_advantages"],
    "trajgrad.group_baselines": ["passk_advantages", "gpg_advantages", "opo_advantages", "remax_advantages",
                                 "optimal_token_baseline"],
    "trajgrad.credit": ["place_turn_rewards", "bootstrap_values", "terminal_token_mask", "last_action_index"],
    "trajgrad.gae": ["gae", "skip_observation_gae", "token_skip_observation_gae", "GAEOutput"],
    "trajgrad.correction": ["rollout_correction", "RolloutCorrection", "turn_metrics", "OFF"],
    "trajgrad.fused": ["fused_token_logprobs", "fused_entropy"],
    "trajgrad.aggregate": ["aggregate", "Normalizer"],
    "trajgrad.losses": ["reinforce_loss", "ppo_clip_loss", "gspo_loss", "gspo_token_loss", "sapo_loss", "sao_dis_loss",
                        "dpo_loss", "kl_estimate", "exact_kl", "reverse_kl_distill_loss", "sampled_token_kl",
                        "multi_teacher_distill_loss", "value_loss", "LagrangeMultiplier", "TeacherRouter"],
    "trajgrad.losses.lagrange": ["LagrangeMultiplier"],
    "trajgrad.losses.teacher_router": ["TeacherRouter"],
    "trajgrad.diagnostics": ["policy_metrics", "explained_variance", "effective_sample_size"],
    "trajgrad.objective": ["Objective", "RECIPES", "explain", "register_policy_term", "register_advantage_estimator"],
    "trajgrad.verify": ["verify"],
}

# Each package's face re-exports the public names of its modules.
FACES = {
    "trajgrad.advantages": ["returns", "td", "baselines", "group_baselines", "normalized", "credit"],
    "trajgrad.logprobs": ["sampling", "ratios"],
    "trajgrad.control": ["lagrange", "teacher_router"],
}


def _first_import(name):
    """Import the old path ``name`` as a first import would: its alias entry leaves the module cache
    (the new module stays, nothing is executed again)."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    importlib.import_module(parent)  # the package itself (trajgrad.losses for trajgrad.losses.lagrange)
    if child in vars(sys.modules[parent]):
        delattr(sys.modules[parent], child)
    __import__(name)  # an import statement's path: the warning names this line
    return sys.modules[name]


@pytest.mark.parametrize("module", sorted(_moved.MOVED))
def test_an_old_path_warns_once_and_is_the_new_module(module):
    new = _moved.MOVED[module]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = _first_import(module)
        again = importlib.import_module(module)
    assert [(w.category, str(w.message)) for w in caught] == [
        (DeprecationWarning, f"{module} moved to {new}; the old path is removed in the next release")]
    assert caught[0].filename == __file__  # attributed to the importing line, not to the import system
    assert mod is again is importlib.import_module(new)
    assert mod.__name__ == mod.__spec__.name == new  # the new module keeps its own name and spec
    for name in PUBLIC.get(module, []):
        assert getattr(mod, name) is not None, f"{module}.{name}"


def test_public_names_import_and_only_old_paths_warn():
    """In a fresh interpreter where a trajgrad DeprecationWarning is an error, every kept public
    name imports; each old path raises its warning."""
    kept = [m for m in PUBLIC if m not in _moved.MOVED]
    lines = [f"from {m} import {', '.join(PUBLIC[m])}" for m in kept]
    lines += [f"""
try:
    import {m}
except DeprecationWarning as w:
    assert "{_moved.MOVED[m]}" in str(w), w
else:
    raise AssertionError("{m} did not warn")""" for m in sorted(_moved.MOVED)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    run = subprocess.run([sys.executable, "-W", "error:trajgrad:DeprecationWarning", "-c", "\n".join(lines)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def test_old_paths_serve_the_moved_objects():
    import trajgrad.advantages as advantages
    import trajgrad.control as control
    import trajgrad.logprobs as logprobs
    import trajgrad.losses as losses

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from trajgrad.baselines import _rewards, group_advantages
        from trajgrad.returns import gae
    assert group_advantages is advantages.group_advantages and gae is advantages.gae
    assert _rewards is importlib.import_module("trajgrad.advantages._groups")._rewards
    assert losses.LagrangeMultiplier is control.LagrangeMultiplier and losses.TeacherRouter is control.TeacherRouter
    assert logprobs.fused_token_logprobs is importlib.import_module("trajgrad.fused").fused_token_logprobs


@pytest.mark.parametrize("face", sorted(FACES))
def test_each_package_face_exports_its_modules_public_names(face):
    pkg = importlib.import_module(face)
    for sub in FACES[face]:
        mod = importlib.import_module(f"{face}.{sub}")
        public = [n for n in mod.__all__ if not n.isupper()] if hasattr(mod, "__all__") else [
            n for n, v in vars(mod).items() if callable(v) and not n.startswith("_") and v.__module__ == mod.__name__]
        assert public, mod
        missing = [n for n in public if getattr(pkg, n, None) is not getattr(mod, n)]
        assert not missing, f"{face} lacks {missing} of {mod.__name__}"
        assert set(public) <= set(pkg.__all__)


def _imported_modules(path: Path):
    """Absolute names of every module an import statement of ``path`` names, function-level ones included."""
    rel = path.relative_to(REPO / "src") if path.is_relative_to(REPO / "src") else None
    package = ".".join(rel.with_suffix("").parts[:-1]) if rel else ""
    if rel and rel.name == "__init__.py":
        package = ".".join(rel.parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for a in node.names:  # ``from trajgrad import returns``
                yield node.lineno, f"{mod}.{a.name}"


def test_nothing_in_the_project_imports_an_old_path():
    files = [p for d in ("src", "tests", "bench", "examples") for p in (REPO / d).rglob("*.py")]
    files = [p for p in files if p.resolve() != Path(__file__).resolve()]
    assert len(files) > 300
    stale = [f"{p.relative_to(REPO)}:{line} imports {name}" for p in files for line, name in _imported_modules(p)
             if name in _moved.MOVED or name in ("trajgrad._scan", "trajgrad._steps")]
    assert not stale, stale


def test_the_root_holds_no_module_of_the_grouped_concepts():
    for old in ["returns", "gae", "baselines", "group_baselines", "advantages", "credit", "_scan", "_steps",
                "logprobs", "ratios", "correction"]:
        assert not (ROOT / f"{old}.py").exists(), old
    for old in ["lagrange", "teacher_router"]:
        assert not (ROOT / "losses" / f"{old}.py").exists(), old
