"""The README's `make test` on a machine without the system packages the tests need.

`make sysdeps` (a prerequisite of `make test`) runs here with a PATH that holds only the few
programs make's shell needs and, in place of apt-get, a script that records its arguments and
"installs" the packages by writing executables with their names.
"""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
PACKAGES = ["bubblewrap", "chromium", "chromium-driver"]

pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _bin(tmp_path, *, have=(), apt_ok=True):
    """A bin directory with sh, cksum, cut, id and a recording apt-get; ``have`` names the system
    programs (bwrap, chromium, chromedriver) already there."""
    b = tmp_path / "bin"
    b.mkdir()
    for tool in ("sh", "cksum", "cut", "id", "cat"):
        (b / tool).symlink_to(shutil.which(tool))
    for prog in have:
        _exe(b / prog, "#!/bin/sh\n")
    log = tmp_path / "apt.log"
    mk = f'{shutil.which("touch")} "$D/%s"; {shutil.which("chmod")} +x "$D/%s"'
    install = ('for p in "$@"; do case "$p" in '
               + "".join(f"{pkg}) {mk % (exe, exe)};; " for pkg, exe in
                         (("bubblewrap", "bwrap"), ("chromium", "chromium"), ("chromium-driver", "chromedriver")))
               + 'esac; done\n')
    _exe(b / "apt-get", f'#!/bin/sh\nD="{b}"\necho "$*" >> "{log}"\n'
         + (install if apt_ok else 'case "$1" in install) exit 100;; esac\n'))
    return b, log


def _make(target, bindir, *, uid, cwd=ROOT):
    env = {"PATH": str(bindir), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([MAKE, "-s", "-C", str(cwd), target, f"SYSDEPS_UID={uid}"], env=env,
                          capture_output=True, text=True, timeout=60)


def test_root_installs_the_missing_packages_with_apt_get(tmp_path):
    b, log = _bin(tmp_path)
    res = _make("sysdeps", b, uid=0)
    assert res.returncode == 0, res.stderr
    assert log.read_text().splitlines() == ["update -qq", "install -y -qq " + " ".join(PACKAGES)]
    assert all((b / p).exists() for p in ("bwrap", "chromium", "chromedriver"))
    again = _make("sysdeps", b, uid=0)  # nothing missing now: silent, nothing installed
    assert again.returncode == 0 and again.stdout == again.stderr == ""
    assert len(log.read_text().splitlines()) == 2


def test_only_the_missing_ones_are_installed(tmp_path):
    b, log = _bin(tmp_path, have=("chromium", "chromedriver"))
    assert _make("sysdeps", b, uid=0).returncode == 0
    assert log.read_text().splitlines() == ["update -qq", "install -y -qq bubblewrap"]


def test_without_root_make_test_stops_at_once_with_the_command(tmp_path):
    # a copy of the Makefile: `make test` must stop before it creates a virtual environment
    proj = tmp_path / "proj"
    proj.mkdir()
    for f in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / f, proj / f)
    b, log = _bin(tmp_path, have=("chromium", "chromedriver"))
    res = _make("test", b, uid=1000, cwd=proj)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if not ln.startswith("make")]
    assert lines == ["sysdeps: the tests need the system packages bubblewrap; run: "
                     "sudo sh -c 'apt-get update && apt-get install -y bubblewrap'"], res.stderr
    assert not log.exists() and not (proj / ".venv").exists()


def test_a_failed_install_stops_with_the_command(tmp_path):
    b, log = _bin(tmp_path, apt_ok=False)
    res = _make("sysdeps", b, uid=0)
    assert res.returncode != 0
    assert ("apt-get could not install bubblewrap chromium chromium-driver; run: apt-get update && "
            "apt-get install -y bubblewrap chromium chromium-driver") in res.stderr


def test_ci_installs_nothing_itself():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get" not in ci and "pip install" not in ci
    assert "make test" in ci and "make peers" in ci
