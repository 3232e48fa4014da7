"""runtime/allocator.py: the trainer's process keeps freed memory for the next step (glibc)."""
import os
import platform
import subprocess
import sys

import pytest

from trajgrad.runtime.allocator import env_equivalent, keep_freed_memory

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")

# a step's pattern in a fresh process: 40 activations of 2 MiB kept until the step's end, then all freed.
# Printed: the resident memory (MiB) the first step hands back to the kernel when it frees them, and the
# page faults of the second step. With glibc's defaults, blocks above the initial mmap threshold (128 KiB)
# are mapped for the first step and unmapped when freed, so the second step faults in fresh pages; later
# steps depend on glibc's dynamic threshold and on how small objects interleave on the heap, so they are
# not measured. Faults alone do not tell the two apart where the kernel maps transparent huge pages (one
# fault per 2 MiB); the resident memory does.
STEPS = r"""
import os, resource, sys
import torch
sys.path.insert(0, {src!r})
if {apply!r}:
    from trajgrad.runtime.allocator import keep_freed_memory
    print(keep_freed_memory(512), file=sys.stderr)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
def step():
    kept = [torch.ones(512 * 1024) for _ in range(40)]
    peak = rss()
    del kept
    return peak - rss()
released = step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(released, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _run(apply: bool, env=None):
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = {k: v for k, v in (env or os.environ).items()}
    out = subprocess.run([sys.executable, "-c", STEPS.format(src=src, apply=apply)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    released, faults = out.stdout.strip().splitlines()[-1].split()
    return float(released), int(faults)


@glibc
def test_freed_memory_is_kept_mapped_instead_of_handed_back():
    """Without the settings glibc hands the first step's 80 MiB back to the kernel when it is freed and the
    second step faults it in again (about 20,000 faults with 4 KiB pages); with them it stays resident and
    the second step reuses it; the environment variables of env_equivalent give the same to a new process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    default, kept = _run(False, clean), _run(True, clean)
    via_env = _run(False, dict(clean, **env_equivalent(512)))
    assert default[0] > 40, (default, kept, via_env)  # MiB handed back by the first step
    assert kept[0] < 4 and via_env[0] < 4, (default, kept, via_env)
    assert max(kept[1], via_env[1]) <= default[1] + 64, (default, kept, via_env)  # page faults of the second


def test_keep_freed_memory_reports_and_validates(monkeypatch):
    assert "defaults" in keep_freed_memory(0)
    for bad in (-1, 1.5, True, "512"):
        with pytest.raises(ValueError, match="train.keep_freed_mb"):
            keep_freed_memory(bad)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    line = keep_freed_memory(512)
    assert "unchanged" in line and "MALLOC_TRIM_THRESHOLD_" in line


def test_the_old_module_path_warns_and_is_the_same_function():
    import importlib
    import sys

    sys.modules.pop("trajgrad.train.allocator", None)
    with pytest.warns(DeprecationWarning, match="trajgrad.runtime.allocator"):
        old = importlib.import_module("trajgrad.train.allocator")
    assert old.keep_freed_memory is keep_freed_memory and old.env_equivalent is env_equivalent
