"""Build script for the compiled parts of topth-ops (project metadata lives in pyproject.toml).

* ``topth_ops.npu_kernels._ascendc_cpu``: the Ascend C kernel (npu_kernels/kernel/) built with
  the host C++ compiler against the CPU model of the Ascend C API (npu_kernels/cpu_model/),
  exposed through pybind11. Always attempted; marked optional so that a machine without a C++
  compiler can still install the package (the ``ascendc-cpu`` backend then reports why it is
  unavailable, and tests/test_ascendc_cpu.py fails).
* ``topth_ops.npu_kernels._ascendc_npu``: the same kernel built for the NPU with CANN, only when
  ASCEND_HOME_PATH is set (see docs/ascendc.md); driven by npu_kernels/npu/CMakeLists.txt.
"""

import os
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
        super().__init__(name, sources=[])
        self.source_dir = source_dir


class build_ext(_build_ext):
    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "npu"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = [
            "cmake", "-S", str(ext.source_dir), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DTOPTH_OUTPUT_DIR={out_dir}",
            f"-DSOC_VERSION={os.environ.get('TOPTH_SOC_VERSION', 'Ascend910B1')}",
        ]
        subprocess.check_call(cfg)
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)])


ext_modules = [cpu_model]
if os.environ.get("ASCEND_HOME_PATH") and os.environ.get("TOPTH_BUILD_NPU", "1") != "0":
    ext_modules.append(CMakeExtension("topth_ops.npu_kernels._ascendc_npu", ROOT / NPU / "npu"))

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
