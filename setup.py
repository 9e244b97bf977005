"""Build script for the compiled parts of topth-ops (project metadata lives in pyproject.toml).

* ``topth_ops.npu_kernels._ascendc_cpu``: the Ascend C kernel (npu_kernels/kernel/) built with
  the host C++ compiler against the CPU model of the Ascend C API (npu_kernels/cpu_model/),
  exposed through pybind11. Always attempted; marked optional so that a machine without a C++
  compiler can still install the package (the ``ascendc-cpu`` backend then reports why it is
  unavailable, and tests/test_ascendc_cpu.py fails).
* ``topth_ops.npu_kernels._ascendc_npu``: the same kernel built for the NPU with CANN, only when
  ASCEND_HOME_PATH is set (see docs/ascendc.md); driven by npu_kernels/npu/CMakeLists.txt. It
  needs cmake, torch and torch_npu in the Python that builds, so under pip's default build
  isolation it cannot build: then (or when its CMake build fails) a warning says why and the
  install goes on without it (``pip install -v`` shows it; the ``ascendc`` backend's reasons
  say how to build it): ``pip install --no-build-isolation -e .`` in the CANN environment.
  TOPTH_BUILD_NPU: ``0`` never builds it; ``required`` makes a failure fail the install.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from pybind11.setup_helpers import build_ext as _build_ext
from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
NPU = Path("npu_kernels")

# Compile the model's sources in parallel (TOPTH_BUILD_JOBS, default: all CPUs).
ParallelCompile("TOPTH_BUILD_JOBS", default=0).install()

cpu_model = Pybind11Extension(
    "topth_ops.npu_kernels._ascendc_cpu",
    sources=[
        str(NPU / "cpu_model" / "src" / "binding.cpp"),
        str(NPU / "cpu_model" / "src" / "core.cpp"),
        str(NPU / "cpu_model" / "src" / "checks.cpp"),
        str(NPU / "cpu_model" / "src" / "selftest.cpp"),
        str(NPU / "kernel" / "topth_decode_attn.cpp"),  # the kernel source, unchanged
    ],
    include_dirs=[str(NPU / "cpu_model" / "include"), str(NPU / "include")],
    cxx_std=20,
    extra_compile_args=["-O2"],
    optional=True,
)
cpu_model.depends = [str(p.relative_to(ROOT)) for p in (ROOT / NPU).rglob("*.h")]


class CMakeExtension(Extension):
    """An extension built by CMake (the NPU kernel and its torch_npu binding)."""

    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[], optional=True)  # the install goes on without it
        self.source_dir = source_dir


NPU_BUILD = os.environ.get("TOPTH_BUILD_NPU", "1").strip().lower()  # 0 | 1 (default) | required
NPU_HINT = ("to build it, source CANN's set_env.sh, install torch and torch_npu, and reinstall with "
            "`pip install --no-build-isolation -e .` (pip's default build isolation hides torch / torch_npu "
            "from the build); TOPTH_BUILD_NPU=0 skips it (docs/ascendc.md)")


class NpuBuildSkipped(Exception):
    """The NPU extension cannot be built here (the reason is the message)."""


class build_ext(_build_ext):
    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        try:
            self._build_cmake(ext)
        except NpuBuildSkipped as e:
            if NPU_BUILD == "required":
                raise RuntimeError(f"TOPTH_BUILD_NPU=required: {ext.name} not built: {e}") from None
            bar = "=" * 78
            print(f"\n{bar}\nWARNING: {ext.name} (the Ascend NPU kernel) was NOT built: {e}.\n"
                  f"The rest of topth-ops installs without it (backend 'ascendc' unavailable); "
                  f"{NPU_HINT}\n{bar}\n", file=sys.stderr, flush=True)

    def _build_cmake(self, ext):
        if shutil.which("cmake") is None:
            raise NpuBuildSkipped("cmake is not on PATH")
        probe = subprocess.run([sys.executable, "-c", "import torch, torch_npu, pybind11"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["?"])[-1]
            raise NpuBuildSkipped(f"torch, torch_npu or pybind11 is not importable by {sys.executable} ({last})")
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "npu"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = [
            "cmake", "-S", str(ext.source_dir), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DTOPTH_OUTPUT_DIR={out_dir}",
            f"-DSOC_VERSION={os.environ.get('TOPTH_SOC_VERSION', 'Ascend910B1')}",
        ]
        for cmd in (cfg, ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)]):
            if subprocess.run(cmd).returncode != 0:
                raise NpuBuildSkipped(f"`{' '.join(cmd[:2])} ...` failed (its output is above)")


ext_modules = [cpu_model]
if NPU_BUILD not in ("0", "1", "required"):
    sys.exit(f"TOPTH_BUILD_NPU must be 0, 1 or required, got {os.environ['TOPTH_BUILD_NPU']!r}")
if NPU_BUILD == "required" or (os.environ.get("ASCEND_HOME_PATH") and NPU_BUILD != "0"):
    ext_modules.append(CMakeExtension("topth_ops.npu_kernels._ascendc_npu", ROOT / NPU / "npu"))

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
