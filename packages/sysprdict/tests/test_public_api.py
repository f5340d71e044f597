"""The public API in a fresh interpreter: importing the package and its CLI leaves torch unloaded
(the command line answers bad input without it), and every name in ``__all__`` resolves."""

import subprocess
import sys

CHECK = """
import sys, sysprdict, sysprdict.cli
assert "torch" not in sys.modules, "import sysprdict loaded torch"
assert "__version__" in sysprdict.__all__ and "TimePredictor" in dir(sysprdict)
print([n for n in sysprdict.__all__ if getattr(sysprdict, n, None) is None])
"""


def test_public_api_in_a_fresh_interpreter():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
