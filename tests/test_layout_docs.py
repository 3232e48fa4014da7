"""The README's Layout section and docs/architecture.md name the tree as it is: every package and
public root module of ``src/trajgrad`` is in the Layout, and every source path either page names exists."""
import re
from pathlib import Path

import trajgrad

ROOT = Path(trajgrad.__file__).parent
REPO = ROOT.parents[1]


def _layout_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def test_every_package_and_public_root_module_is_in_the_layout():
    block = _layout_block()
    names = [p.name + "/" for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    names += [p.name for p in ROOT.glob("*.py") if not p.name.startswith("_")]
    missing = [n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", block)]
    assert not missing, f"README Layout does not name: {missing}"


def test_every_source_path_the_pages_name_exists():
    for page in (REPO / "README.md", REPO / "docs" / "architecture.md"):
        text = _layout_block() if page.name == "README.md" else page.read_text()
        for path in set(re.findall(r"(?<![\w/.])((?:[a-z_]+/)+[a-z_]+\.py)\b", text)):
            assert (ROOT / path).exists() or (REPO / path).exists(), f"{page.name} names {path}, which does not exist"
        for name in set(re.findall(r"(?<![\w/.])([a-z_]+\.py)\b", text)):
            if name in ("pip.py",):
                continue
            hits = list(ROOT.rglob(name)) + list((REPO / "tests").glob(name))
            assert hits, f"{page.name} names {name}, which is in no package"
