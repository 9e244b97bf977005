"""Every module of the package imports on its own, first, in a fresh interpreter state
(a circular import between a module and its re-exporting parent fails only in one order)."""

import subprocess
import sys

SCRIPT = r"""
import importlib, pkgutil, sys
import torch  # noqa: F401  (stays loaded; only our pure-Python modules are dropped between imports)
import topth_ops
names = sorted(m.name for m in pkgutil.iter_modules(topth_ops.__path__, "topth_ops.") if not m.ispkg and m.name != "topth_ops.__main__")
names += ["topth_ops.hf", "topth_ops.conformance", "topth_ops.backends"]
failed = []
for name in names:
    for key in [k for k in sys.modules if k.startswith("topth_ops")]:
        if str(getattr(sys.modules[key], "__file__", "") or "").endswith(".py"):
            del sys.modules[key]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(len(names))
print("\n".join(failed))
"""


def test_each_module_imports_first():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert int(lines[0]) > 20, "too few modules found"
    assert lines[1:] == [], "\n".join(lines[1:])
