"""The import graph of trajgrad: no circles, no private names across a public face, no hidden imports.

An AST scan of every module under ``src/trajgrad`` (nothing is imported to build the graph):

(a) **No cycles.** An edge ``A -> B`` is any ``import``/``from ... import`` in ``A`` that names
    the trajgrad module ``B``, at any level (module top, function bodies, class bodies).
    ``from P import x`` is an edge to ``P.x`` when ``P.x`` is a module, else to ``P`` (its
    ``__init__``). A package's lazy attribute table (a module-level ``_LAZY`` dict in its
    ``__init__``: attribute -> submodule, read by the package's PEP 562 ``__getattr__``) adds an
    edge from the package to each submodule it names; each must exist. Every cycle is
    reported as a path ``a -> b -> ... -> a`` (one per strongly connected set of modules).

(b) **No private name across a public face.** A name ``_x`` (not a dunder) defined in module
    ``M`` is used only inside ``M``: ``from M import _x``, ``import M`` then ``M._x`` elsewhere
    fail. The exception is a private module: a module or package whose own name starts with
    ``_`` (``fused/_blocks.py``, ``_checks.py``, ``verify/_common.py``) is the internal API of
    the package that holds it, so the modules of that package and of its subpackages may
    import it and any of its names (``trajgrad.fused.*`` may use ``trajgrad.fused._blocks._mm``;
    every trajgrad module may use ``trajgrad._checks``); importing it from outside that
    package fails.

(c) **trajgrad's own modules are imported at the top.** An import of a trajgrad module inside
    a function fails. Function-level imports of optional third-party packages (transformers,
    peft, ray, vLLM, fastapi, httpx, gymnasium, datasets, trackers, ...) stay where they are,
    so that a missing package is reported where its feature is used. The one lazy mechanism
    is the package ``_LAZY`` table of (a), which the graph includes: ``trajgrad`` and
    ``trajgrad.train`` load their heavier subpackages on first attribute access, so that
    ``import trajgrad`` and ``trajgrad --help`` stay light (the command line calls
    ``trajgrad.train.run.main(...)`` after ``import trajgrad`` at its top).

The violations still present are listed exactly below, each with the change that removes it.
The test also fails when a listed entry no longer occurs, so each list only shrinks.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import trajgrad

ROOT = Path(trajgrad.__file__).parent
PACKAGE = "trajgrad"

# Each list holds (importer, ...) entries still allowed, with the change that removes each; all are empty
# now and may only shrink.

# Edges (importer, imported) that close a cycle still present; the graph without them must be
# acyclic and each must still lie on a cycle of the full graph.
CYCLE_EDGES_ALLOWED: Dict[Tuple[str, str], str] = {}

# (importer, "module._name") taken across a module's public face.
PRIVATE_ALLOWED: Dict[Tuple[str, str], str] = {}

# (importer, imported module) imported inside a function of the importer.
FUNCTION_LEVEL_ALLOWED: Dict[Tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


class Scan:
    """Edges, function-level imports and private-name uses of every trajgrad module."""

    def __init__(self, files: Dict[str, Path], root: Path = ROOT):
        self.files = files
        self.root = root
        self.mods: Set[str] = set(files)
        self.edges: Dict[str, Set[str]] = defaultdict(set)
        self.function_level: Set[Tuple[str, str]] = set()
        self.private: Set[Tuple[str, str]] = set()
        self.where: Dict[tuple, str] = {}
        self.missing_lazy: List[str] = []
        for name, path in files.items():
            self._scan(name, path)

    def _resolve_from(self, module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if is_pkg else module.rpartition(".")[0]
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def _use(self, importer: str, target: str, name: Optional[str], line: int, in_function: bool) -> None:
        """Record ``importer`` using module ``target`` (and its attribute ``name``, if any)."""
        self.edges[importer].add(target)
        here = f"{self.files[importer].relative_to(self.root.parent)}:{line}"
        if in_function:
            self.function_level.add((importer, target))
            self.where.setdefault(("f", importer, target), here)
        if not self._may_see(importer, target):
            self.private.add((importer, target))
            self.where.setdefault(("p", importer, target), here)
        if name is not None and _private(name) and importer != target and not self._in_private_scope(target):
            self.private.add((importer, f"{target}.{name}"))
            self.where.setdefault(("p", importer, f"{target}.{name}"), here)

    @staticmethod
    def _scope(target: str) -> Optional[str]:
        """The package whose internal API ``target`` is (its outermost private part's parent)."""
        parts = target.split(".")
        for i, part in enumerate(parts):
            if _private(part):
                return ".".join(parts[:i])
        return None

    def _in_private_scope(self, target: str) -> bool:
        return self._scope(target) is not None

    def _may_see(self, importer: str, target: str) -> bool:
        scope = self._scope(target)
        return scope is None or importer == scope or importer.startswith(scope + ".")

    def _scan(self, module: str, path: Path) -> None:
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        bound: Dict[str, str] = {}  # local name -> trajgrad module it is bound to
        self._lazy_table(module, is_pkg, tree)
        for node, in_function in _walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != PACKAGE:
                        continue
                    target = alias.name if alias.name in self.mods else alias.name.rpartition(".")[0]
                    self._use(module, target, None, node.lineno, in_function)
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = PACKAGE
            elif isinstance(node, ast.ImportFrom):
                source = self._resolve_from(module, is_pkg, node)
                if source.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in self.mods:
                        self._use(module, sub, None, node.lineno, in_function)
                        bound[alias.asname or alias.name] = sub
                    else:
                        self._use(module, source, alias.name, node.lineno, in_function)
            elif isinstance(node, ast.Attribute):
                owner = _bound_module(node.value, bound, self.mods)
                if owner is not None and f"{owner}.{node.attr}" not in self.mods and _private(node.attr):
                    self._use(module, owner, node.attr, node.lineno, False)  # a use, not an import

    def _lazy_table(self, module: str, is_pkg: bool, tree: ast.Module) -> None:
        for node in tree.body:
            if (is_pkg and isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                    and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)):
                for value in node.value.values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        sub = f"{module}.{value.value}"
                        if sub in self.mods:
                            self.edges[module].add(sub)
                        else:
                            message = f"{module}._LAZY names {sub}, which does not exist"
                            if message not in self.missing_lazy:
                                self.missing_lazy.append(message)


def _walk(tree: ast.AST) -> Iterator[Tuple[ast.AST, bool]]:
    stack: List[Tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield child, in_function
            stack.append((child, inner))


def _bound_module(expr: ast.AST, bound: Dict[str, str], mods: Set[str]) -> Optional[str]:
    if isinstance(expr, ast.Name):
        return bound.get(expr.id)
    if isinstance(expr, ast.Attribute):
        owner = _bound_module(expr.value, bound, mods)
        if owner is not None and f"{owner}.{expr.attr}" in mods:
            return f"{owner}.{expr.attr}"
    return None


def strongly_connected(edges: Dict[str, Set[str]], nodes: Set[str]) -> List[List[str]]:
    """Tarjan's components of size > 1 (or with a self-loop), iteratively."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in nodes:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in edges.get(v, ()):
                        out.append(sorted(comp))
    return out


def cycle_path(edges: Dict[str, Set[str]], component: List[str]) -> str:
    """A shortest cycle through the component's first module, as ``a -> b -> a``."""
    members = set(component)
    start = component[0]
    previous: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [start]
                    while v != start:
                        path.append(v)
                        v = previous[v]
                    return " -> ".join([start] + path[:0:-1] + [start]) if len(path) > 1 else f"{start} -> {start}"
                if w in members and w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return " -> ".join(component)


def _without(edges: Dict[str, Set[str]], removed) -> Dict[str, Set[str]]:
    return {a: {b for b in bs if (a, b) not in removed} for a, bs in edges.items()}


def _report(scan: Scan) -> Tuple[List[str], Dict[str, int]]:
    problems: List[str] = list(scan.missing_lazy)
    full = strongly_connected(scan.edges, scan.mods)
    rest = strongly_connected(_without(scan.edges, CYCLE_EDGES_ALLOWED), scan.mods)
    for comp in rest:
        problems.append("import cycle: " + cycle_path(_without(scan.edges, CYCLE_EDGES_ALLOWED), comp))
    on_cycle = {(a, b) for comp in full for a in comp for b in comp if b in scan.edges.get(a, ())}
    for edge in CYCLE_EDGES_ALLOWED:
        if edge not in on_cycle:
            problems.append(f"allowlisted cycle edge {edge[0]} -> {edge[1]} no longer closes a cycle: remove it")
    for entry in sorted(scan.private - set(PRIVATE_ALLOWED)):
        problems.append(f"private name across a public face: {scan.where[('p', *entry)]}: {entry[0]} uses {entry[1]}")
    for entry in sorted(set(PRIVATE_ALLOWED) - scan.private):
        problems.append(f"allowlisted private use {entry[0]} -> {entry[1]} no longer occurs: remove it")
    for entry in sorted(scan.function_level - set(FUNCTION_LEVEL_ALLOWED)):
        problems.append(f"function-level import: {scan.where[('f', *entry)]}: {entry[0]} imports {entry[1]} "
                        f"inside a function (import it at the top)")
    for entry in sorted(set(FUNCTION_LEVEL_ALLOWED) - scan.function_level):
        problems.append(f"allowlisted function-level import {entry[0]} -> {entry[1]} no longer occurs: remove it")
    counts = {"cycles": len(full), "private names": len(scan.private),
              "function-level trajgrad imports": len(scan.function_level)}
    return problems, counts


def test_the_import_graph_has_no_cycles_no_private_names_no_hidden_imports():
    scan = Scan(modules())
    assert len(scan.mods) > 150
    problems, counts = _report(scan)
    summary = ", ".join(f"{k}: {v}" for k, v in counts.items())
    assert not problems, f"{len(problems)} import-graph problems ({summary}; allowlisted: "\
        f"{len(CYCLE_EDGES_ALLOWED)} cycle edges, {len(PRIVATE_ALLOWED)} private, "\
        f"{len(FUNCTION_LEVEL_ALLOWED)} function-level):\n" + "\n".join(problems)


# ---- the scan itself, on small synthetic trees: each rule can fail -----------------------------------

def _tree(tmp_path: Path, files: Dict[str, str]) -> Dict[str, Path]:
    out = {}
    for rel, text in files.items():
        p = tmp_path / PACKAGE / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for p in sorted((tmp_path / PACKAGE).rglob("*.py")):
        parts = list(p.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _scan(tmp_path: Path, files: Dict[str, str]) -> Scan:
    return Scan(_tree(tmp_path, files), root=tmp_path / PACKAGE)


def test_a_function_level_cycle_is_found_and_printed_as_a_path(tmp_path):
    scan = _scan(tmp_path, {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .c import g\n",
        "c.py": "import trajgrad.a\n",
    })
    comps = strongly_connected(scan.edges, scan.mods)
    assert comps == [["trajgrad.a", "trajgrad.b", "trajgrad.c"]]
    assert cycle_path(scan.edges, comps[0]) == "trajgrad.a -> trajgrad.b -> trajgrad.c -> trajgrad.a"
    assert scan.function_level == {("trajgrad.b", "trajgrad.c")}


def test_from_package_import_submodule_is_an_edge_to_the_submodule(tmp_path):
    scan = _scan(tmp_path, {
        "__init__.py": "",
        "p/__init__.py": "from .x import name\n",
        "p/x.py": "from . import y\nfrom trajgrad.p import z\n",
        "p/y.py": "", "p/z.py": "",
    })
    assert scan.edges["trajgrad.p.x"] == {"trajgrad.p.y", "trajgrad.p.z"}
    assert scan.edges["trajgrad.p"] == {"trajgrad.p.x"}
    assert strongly_connected(scan.edges, scan.mods) == []


def test_private_names_and_private_modules(tmp_path):
    scan = _scan(tmp_path, {
        "__init__.py": "",
        "_core.py": "_shared = 1\n",
        "pub.py": "_hidden = 1\n",
        "user.py": "from .pub import _hidden\nfrom . import pub\nx = pub._hidden\nfrom ._core import _shared\n",
        "f/__init__.py": "", "f/_blocks.py": "_mm = 1\n", "f/g/__init__.py": "",
        "f/ok.py": "from ._blocks import _mm\n",
        "f/g/deep.py": "from .._blocks import _mm\n",
        "other.py": "from .f._blocks import _mm\nfrom .f import _blocks\n",
    })
    assert scan.private == {("trajgrad.user", "trajgrad.pub._hidden"), ("trajgrad.other", "trajgrad.f._blocks")}


def test_lazy_tables_are_edges_and_must_name_real_submodules(tmp_path):
    scan = _scan(tmp_path, {
        "__init__.py": "_LAZY = {'thing': 'impl', 'gone': 'missing'}\n",
        "impl.py": "import trajgrad\n",
    })
    assert "trajgrad.impl" in scan.edges["trajgrad"]
    assert scan.missing_lazy == ["trajgrad._LAZY names trajgrad.missing, which does not exist"]
    assert strongly_connected(scan.edges, scan.mods) == [["trajgrad", "trajgrad.impl"]]


def test_a_stale_allowlist_entry_fails(tmp_path, monkeypatch):
    scan = _scan(tmp_path, {"__init__.py": "", "a.py": "def f():\n    from . import b\n", "b.py": ""})
    monkeypatch.setattr(sys.modules[__name__], "CYCLE_EDGES_ALLOWED", {("trajgrad.a", "trajgrad.b"): "x"})
    monkeypatch.setattr(sys.modules[__name__], "PRIVATE_ALLOWED", {("trajgrad.a", "trajgrad.b._gone"): "x"})
    monkeypatch.setattr(sys.modules[__name__], "FUNCTION_LEVEL_ALLOWED", {})
    problems, counts = _report(scan)
    assert counts == {"cycles": 0, "private names": 0, "function-level trajgrad imports": 1}
    assert problems == [
        "allowlisted cycle edge trajgrad.a -> trajgrad.b no longer closes a cycle: remove it",
        "allowlisted private use trajgrad.a -> trajgrad.b._gone no longer occurs: remove it",
        "function-level import: trajgrad/a.py:2: trajgrad.a imports trajgrad.b inside a function (import it at the top)",
    ]


def test_every_module_imports_without_the_optional_packages():
    """Imports at the top must not pull an optional package in: with every package of an extra made
    unimportable, each trajgrad module still imports (the feature then says which package it needs)."""
    from trajgrad._optional import EXTRAS

    blocked = sorted(set(EXTRAS) | {"vllm", "trl", "verl", "starlette", "tokenizers"})
    code = (
        "import importlib, importlib.abc, sys\n"
        f"BLOCKED = {blocked!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        failed.append(f'{name}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )
    names = [m for m in modules() if not m.endswith("__main__")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "", proc.stdout
