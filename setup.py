"""Build script for the compiled parts of topth-ops (project metadata lives in pyproject.toml).

* ``topth_ops.npu_kernels._ascendc_cpu``: the Ascend C kernel (npu_kernels/kernel/) built with
  the host C++ compiler against the CPU model of the Ascend C API (npu_kernels/cpu_model/),
  exposed through pybind11. Always attempted; marked optional so that a machine without a C++
  compiler can still install the package (the ``ascendc-cpu`` backend then reports why it is
  unavailable, and tests/backends/ascendc/test_ascendc_cpu.py fails).
* ``topth_ops.npu_kernels._ascendc_npu``: the same kernel built for the NPU with CANN, only when
  ASCEND_HOME_PATH is set (see docs/ascendc.md); driven by npu_kernels/npu/CMakeLists.txt. It
  needs cmake, torch and torch_npu in the Python that builds, so under pip's default build
  isolation it cannot build: then (or when its CMake build fails) a warning says why and the
  install goes on without it (``pip install -v`` shows it; the ``ascendc`` backend's reasons
  say how to build it): ``pip install --no-build-isolation -e .`` in the CANN environment.
  TOPTH_BUILD_NPU: ``0`` never builds it; ``required`` makes a failure fail the install.
* ``topth_ops.cpu_kernels._topth_cpu``: the CPU kernel (backend ``cpu``, cpu_kernels/,
  docs/cpu.md), pybind11 without torch headers. Optional like the CPU model: without a
  C++17 compiler the install goes on and the ``cpu`` backend reports why it is
  unavailable (``torch`` runs instead). On x86-64 its SIMD stages are also compiled with
  AVX2 and AVX-512 target flags (one file each, chosen at run time); a compiler that
  rejects those flags drops that level with a warning.
"""

import os
import platform
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
        str(NPU / "cpu_model" / "src" / "hazard.cpp"),
        str(NPU / "cpu_model" / "src" / "sync.cpp"),
        str(NPU / "cpu_model" / "src" / "selftest.cpp"),
        str(NPU / "cpu_model" / "src" / "selftest_cube.cpp"),
        str(NPU / "kernel" / "topth_decode_attn.cpp"),  # the kernel sources, unchanged
        str(NPU / "kernel" / "topth_decode_attn_cube.cpp"),
    ],
    include_dirs=[str(NPU / "cpu_model" / "include"), str(NPU / "include")],
    cxx_std=20,
    extra_compile_args=["-O2"],
    optional=True,
)
cpu_model.depends = [str(p.relative_to(ROOT)) for p in (ROOT / NPU).rglob("*.h")]

CPU = Path("cpu_kernels")
CPU_SRC = CPU / "src"
cpu_kernel = Pybind11Extension(
    "topth_ops.cpu_kernels._topth_cpu",
    sources=[str(CPU_SRC / f) for f in ("binding.cpp", "dispatch.cpp", "item.cpp", "unit_walk.cpp",
                                        "packed.cpp", "combine.cpp", "pool.cpp", "simd_generic.cpp", "value_sum.cpp",
                                        "calib_hist.cpp", "table_check.cpp")],
    include_dirs=[str(CPU / "include"), str(CPU_SRC)],
    cxx_std=17,
    extra_compile_args=["-O3"],
    extra_link_args=["-pthread"],
    optional=True,
)
cpu_kernel.depends = [str(p.relative_to(ROOT)) for p in (ROOT / CPU).rglob("*.h")] + [
    str(CPU_SRC / "stages_portable.inc"), str(CPU_SRC / "scalar_convert.inc")]
# SIMD levels compiled with their own target flags (x86-64 only): (macro, flags, sources, needs)
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
cpu_kernel.simd_levels = []
if platform.machine().lower() in ("x86_64", "amd64"):
    cpu_kernel.simd_levels = [
        ("TOPTH_HAVE_AVX2", ["-mavx2", "-mfma", "-mf16c"], [str(CPU_SRC / f) for f in ("avx2_scores.cpp", "avx2_select.cpp", "avx2_pv.cpp")], None),
        ("TOPTH_HAVE_AVX512", AVX512_FLAGS,
         [str(CPU_SRC / f) for f in ("avx512_scores.cpp", "avx512_kt.cpp", "avx512_select.cpp", "avx512_pv.cpp")], None),
        # reuses every stage of the AVX-512 level but the bfloat16 scores (rows and transposed K)
        ("TOPTH_HAVE_AVX512BF16", AVX512_FLAGS + ["-mavx512bf16"], [str(CPU_SRC / f) for f in ("avx512bf16_scores.cpp", "avx512bf16_kt.cpp")],
         "TOPTH_HAVE_AVX512"),
        # the avx512bf16 level with the bfloat16 scores on AMX tiles
        ("TOPTH_HAVE_AMX", AVX512_FLAGS + ["-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
         [str(CPU_SRC / "amx_scores.cpp")], "TOPTH_HAVE_AVX512BF16"),
    ]


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
        if getattr(ext, "simd_levels", None):
            self._compile_simd_levels(ext)
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

    def _compile_simd_levels(self, ext):
        """Compile each SIMD level's sources with its target flags into extra objects; a level the
        compiler rejects is left out (the kernel then runs the next level down)."""
        from distutils.errors import CompileError

        for macro, flags, sources, needs in ext.simd_levels:
            if needs and (needs, "1") not in (ext.define_macros or []):
                print(f"WARNING: {ext.name}: SIMD level {macro} not built (it needs {needs}, not built)",
                      file=sys.stderr, flush=True)
                continue
            try:
                objects = self.compiler.compile(
                    sources, output_dir=self.build_temp, macros=ext.define_macros, include_dirs=ext.include_dirs,
                    extra_postargs=ext.extra_compile_args + flags, depends=ext.depends)
            except CompileError as e:
                print(f"WARNING: {ext.name}: SIMD level {macro} not built ({e}); the kernel runs without it",
                      file=sys.stderr, flush=True)
                continue
            ext.extra_objects = list(ext.extra_objects or []) + objects
            ext.define_macros = list(ext.define_macros or []) + [(macro, "1")]
        ext.simd_levels = []

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


ext_modules = [cpu_model, cpu_kernel]
if NPU_BUILD not in ("0", "1", "required"):
    sys.exit(f"TOPTH_BUILD_NPU must be 0, 1 or required, got {os.environ['TOPTH_BUILD_NPU']!r}")
if NPU_BUILD == "required" or (os.environ.get("ASCEND_HOME_PATH") and NPU_BUILD != "0"):
    ext_modules.append(CMakeExtension("topth_ops.npu_kernels._ascendc_npu", ROOT / NPU / "npu"))

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
