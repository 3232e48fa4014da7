"""bench/bench_shared_prefix.py runs, checks its two sides agree, and keeps one section per shape."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_shared_prefix", Path(__file__).parent.parent / "bench" / "bench_shared_prefix.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_small_run_writes_one_section_per_shape(tmp_path):
    out = tmp_path / "shared_prefix.md"
    small = ["--threads", "1", "--rounds", "1", "--prompts", "2", "--group", "3", "--new", "3", "--out", str(out)]
    bench.main(small + ["--prompt-len", "12"])
    bench.main(small + ["--prompt-len", "12"])  # the same shape again: replaces its section
    bench.main(small + ["--prompt-len", "20"])
    text = out.read_text()
    assert text.count("## 2 prompts x G = 3, prompts of 12 tokens") == 1
    assert text.count("## 2 prompts x G = 3, prompts of 20 tokens") == 1
    assert text.count("| **ratio** |") == 2 and "less |" in text
