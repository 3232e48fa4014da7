"""Optional packages: a missing one is one line naming the feature and the install command."""
import subprocess
import sys

import pytest

from trajgrad._optional import MissingPackage, install_hint, require


def test_present_package_is_returned():
    assert require("json", "anything").dumps([1]) == "[1]"


def test_missing_package_names_feature_package_and_extra(monkeypatch):
    import trajgrad._optional as opt

    monkeypatch.setitem(opt.EXTRAS, "no_such_pkg_xyz", "dist")
    with pytest.raises(MissingPackage) as info:
        require("no_such_pkg_xyz.sub", "rollout.backend: openai")
    msg = str(info.value)
    assert "rollout.backend: openai" in msg and "'no_such_pkg_xyz'" in msg
    assert 'trajgrad[dist]' in msg and "\n" not in msg


def test_unknown_package_hint_is_plain_pip():
    assert install_hint("zzz_unknown.mod") == "pip install zzz_unknown"


def test_a_broken_import_inside_a_present_package_is_not_hidden(tmp_path, monkeypatch):
    pkg = tmp_path / "halfbroken_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import no_such_dependency_abc\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        require("halfbroken_pkg", "a feature")
    assert not isinstance(info.value, MissingPackage)
    assert info.value.name == "no_such_dependency_abc"


def test_cli_prints_one_line_for_a_missing_package(tmp_path):
    code = ("import sys, trajgrad.cli as cli\n"
            "from trajgrad._optional import require\n"
            "@cli.app.command('needs-missing')\n"
            "def needs_missing():\n"
            "    require('no_such_pkg_xyz', 'this command')\n"
            "sys.argv = ['trajgrad', 'needs-missing']\n"
            "cli.main()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["error: this command needs the package 'no_such_pkg_xyz', which is not installed: "
                     "pip install no_such_pkg_xyz"], proc.stderr
