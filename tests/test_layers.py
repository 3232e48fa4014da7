"""Dependencies point downward only: the core imports nothing from the layers above it."""
import ast
from pathlib import Path

import trajgrad

ROOT = Path(trajgrad.__file__).parent
CORE_MODULES = ["_checks", "_aggregation", "_policy_stats", "_moved", "aggregate", "diagnostics", "turn_stats",
                "entropy_control", "types", "registry"]
# log-probs and ratios; advantages and returns; the objective's steered coefficients; chunked kernels; losses
CORE_PACKAGES = ["logprobs", "advantages", "control", "fused", "losses"]
ABOVE = ("trajgrad.train", "trajgrad.rollout", "trajgrad.serve", "trajgrad.envs", "trajgrad.model", "trajgrad.weights",
         "trajgrad.peers", "trajgrad.verify", "trajgrad.cli", "trajgrad.objective", "trajgrad.terms",
         "trajgrad.estimators", "trajgrad.recipes", "trajgrad.explain")
THIRD_PARTY_ABOVE = ("transformers", "peft", "ray", "fastapi", "trl", "verl")


def _imports(path: Path, package: str):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module or ""


def _core_files():
    for m in CORE_MODULES:
        yield ROOT / f"{m}.py", "trajgrad"
    for pkg in CORE_PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            yield f, "trajgrad." + pkg


def test_the_core_imports_nothing_from_above():
    seen = 0
    for path, package in _core_files():
        assert path.exists(), path
        seen += 1
        for name in _imports(path, package):
            assert not name.startswith(ABOVE), f"{path.relative_to(ROOT)} imports {name}"
            assert name.split(".")[0] not in THIRD_PARTY_ABOVE, f"{path.relative_to(ROOT)} imports {name}"
    assert seen >= 50  # 8 modules + every file of the 5 packages


def test_the_scan_resolves_relative_imports():
    names = set(_imports(ROOT / "losses" / "ppo.py", "trajgrad.losses"))
    assert any(n.startswith("trajgrad.") for n in names)
