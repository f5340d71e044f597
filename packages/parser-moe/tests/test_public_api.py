"""The public API in a fresh interpreter: importing the package and its CLI leaves torch unloaded,
``parser_moe.calibrate`` stays the function once its submodule is imported, and every name in
``__all__`` resolves."""

import subprocess
import sys

CHECK = """
import sys, parser_moe, parser_moe.cli
assert "torch" not in sys.modules, "import parser_moe loaded torch"
import parser_moe.calibrate
assert callable(parser_moe.calibrate), parser_moe.calibrate
assert "__version__" in parser_moe.__all__ and "compress_model" in dir(parser_moe)
print([n for n in parser_moe.__all__ if getattr(parser_moe, n, None) is None])
"""


def test_public_api_in_a_fresh_interpreter():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
