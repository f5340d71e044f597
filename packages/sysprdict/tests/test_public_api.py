"""Every name the package exports resolves, and importing the package alone leaves torch unloaded
(the command line answers bad input without it)."""

import subprocess
import sys

import sysprdict


def test_every_exported_name_resolves():
    assert "__version__" in sysprdict.__all__ and "TimePredictor" in dir(sysprdict)
    missing = [n for n in sysprdict.__all__ if getattr(sysprdict, n, None) is None]
    assert missing == []


def test_import_does_not_load_torch():
    code = "import sys, sysprdict, sysprdict.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
