"""lopt.integrations imports no framework until one of its framework classes is used."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate", "timm")


def test_importing_the_glue_modules_imports_no_framework():
    code = ("import sys, lopt, lopt.integrations, lopt.integrations.transformers, lopt.integrations.lightning, "
            "lopt.integrations.timm\n"
            f"print(sorted(name for name in {FRAMEWORKS!r} if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
