"""train/allocator.py: the trainer's process keeps freed memory for the next step (glibc)."""
import os
import platform
import subprocess
import sys

import pytest

from trajgrad.train.allocator import env_equivalent, keep_freed_memory

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")

# a step's pattern: 40 activations of 2 MiB kept until its end, then all freed; page faults of steps 3-10
STEPS = r"""
import resource, sys
import torch
sys.path.insert(0, {src!r})
if {apply!r}:
    from trajgrad.train.allocator import keep_freed_memory
    print(keep_freed_memory(512), file=sys.stderr)
def step():
    kept = [torch.ones(512 * 1024) for _ in range(40)]
    return sum(float(t[0]) for t in kept)
for _ in range(2):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(apply: bool, env=None) -> int:
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = {k: v for k, v in (env or os.environ).items()}
    out = subprocess.run([sys.executable, "-c", STEPS.format(src=src, apply=apply)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


@glibc
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    """Without the settings glibc hands part of each step's 80 MiB back and faults it in again
    (about 2,600 pages a step here); with them the pages stay mapped (none); the environment
    variables of env_equivalent give the same settings to a new process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    default, kept = _faults(False, clean), _faults(True, clean)
    via_env = _faults(False, dict(clean, **env_equivalent(512)))
    assert default > 8 * 1_000, default
    assert kept < default / 10 and via_env < default / 10, (default, kept, via_env)


def test_keep_freed_memory_reports_and_validates(monkeypatch):
    assert "defaults" in keep_freed_memory(0)
    for bad in (-1, 1.5, True, "512"):
        with pytest.raises(ValueError, match="train.keep_freed_mb"):
            keep_freed_memory(bad)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    line = keep_freed_memory(512)
    assert "unchanged" in line and "MALLOC_TRIM_THRESHOLD_" in line
