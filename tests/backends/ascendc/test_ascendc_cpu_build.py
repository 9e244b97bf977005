"""Build checks of the Ascend C kernel that need no CANN:

* the kernel builds against both spellings of the row reductions: WholeReduceSum /
  WholeReduceMax (CANN <= 9.0) and ReduceRepeat<SUM / MAX> (asc-devkit >= 9.1.0-beta.2),
  chosen by the toolchain's ASC_DEVKIT_VERSION_NUM; a kernel that calls one spelling
  directly does not (g++ -fsyntax-only against the CPU model in each mode);
* npu/CMakeLists.txt finds CANN's kernel CMake, libraries and headers in every install
  layout it probes, links the libraries CANN's own kernel-launch builds link, and names a
  missing one (cmake -DTOPTH_PROBE_ONLY=ON against stub CANN trees).

About 15 s on 2 cores (six syntax checks, four CMake configures). Skipped only when g++ or
cmake is missing (the package build itself needs g++).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NPU = ROOT / "npu_kernels"
NEW_CANN = "90100000"  # asc-devkit 9.1.0: ReduceRepeat only
OLD_CANN = "80500000"  # asc-devkit 8.5.0: WholeReduceSum / WholeReduceMax only

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


def _syntax_check(source: Path, *defines: str) -> subprocess.CompletedProcess:
    cmd = ["g++", "-std=c++20", "-fsyntax-only", f"-I{NPU / 'cpu_model' / 'include'}", f"-I{NPU / 'include'}",
           f"-I{NPU / 'kernel'}", *[f"-D{d}" for d in defines], str(source)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@needs_gxx
@pytest.mark.parametrize("version", [NEW_CANN, OLD_CANN])
@pytest.mark.parametrize("entry", ["topth_decode_attn.cpp", "topth_decode_attn_cube.cpp"])
def test_the_kernel_builds_against_both_reduce_spellings(version, entry):
    r = _syntax_check(NPU / "kernel" / entry, f"TOPTH_MODEL_CANN_VERSION_NUM={version}")
    assert r.returncode == 0, r.stderr[-3000:]


@needs_gxx
def test_a_direct_call_of_the_old_name_fails_on_new_cann(tmp_path):
    """The bug kind: calling WholeReduceSum directly (or forcing the old spelling) does not
    build against asc-devkit 9.1, so the wrapper in topth_common.h is what keeps it building."""
    src = tmp_path / "direct.cpp"
    src.write_text('#include "topth_common.h"\n'
                   "void f(const AscendC::LocalTensor<float>& d, const AscendC::LocalTensor<float>& s) {\n"
                   "    AscendC::WholeReduceSum<float>(d, s, 64, 1, 1, 1, 8);\n}\n")
    assert _syntax_check(src, f"TOPTH_MODEL_CANN_VERSION_NUM={OLD_CANN}").returncode == 0
    bad = _syntax_check(src, f"TOPTH_MODEL_CANN_VERSION_NUM={NEW_CANN}")
    assert bad.returncode != 0 and "WholeReduceSum" in bad.stderr
    forced = _syntax_check(NPU / "kernel" / "topth_decode_attn.cpp", f"TOPTH_MODEL_CANN_VERSION_NUM={NEW_CANN}",
                           "TOPTH_USE_REDUCE_REPEAT=0")
    assert forced.returncode != 0


# ----------------------------------------------------------------------------- CMake probe

REQUIRED_LIBS = ("ascendcl", "platform", "tiling_api", "register", "graph_base", "unified_dlog")

# (kernel CMake dir, library dir, include dir) relative to ASCEND_HOME_PATH, per install layout
LAYOUTS = {
    "toolkit": ("compiler/tikcpp/ascendc_kernel_cmake", "lib64", "include"),
    "tools": ("tools/tikcpp/ascendc_kernel_cmake", "lib64", "include"),
    "arch_tree": ("x86_64-linux/tikcpp/ascendc_kernel_cmake", "x86_64-linux/lib64", "x86_64-linux/include"),
    "devkit_split": ("ascendc_devkit/tikcpp/samples/cmake", "runtime/lib64", "runtime/include"),
}


def _stub_cann(root: Path, layout: str, missing: str = "") -> Path:
    kdir, ldir, idir = LAYOUTS[layout]
    (root / kdir).mkdir(parents=True)
    (root / kdir / "ascendc.cmake").write_text("function(ascendc_library)\nendfunction()\n")
    (root / ldir).mkdir(parents=True, exist_ok=True)
    for lib in REQUIRED_LIBS + ("mmpa", "c_sec"):
        if lib != missing:
            (root / ldir / f"lib{lib}.so").write_bytes(b"")
    (root / idir).mkdir(parents=True, exist_ok=True)
    return root


def _probe(tmp_path: Path, cann: Path) -> subprocess.CompletedProcess:
    cmd = ["cmake", "-S", str(NPU / "npu"), "-B", str(tmp_path / "build"), "-DTOPTH_PROBE_ONLY=ON",
           f"-DASCEND_CANN_PACKAGE_PATH={cann}", "-DCMAKE_SYSTEM_PROCESSOR=x86_64"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _probed(out: str, key: str) -> str:
    line = next(x for x in out.splitlines() if f"TOPTH_PROBE {key}=" in x)
    return line.split(f"TOPTH_PROBE {key}=", 1)[1]


@needs_cmake
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cmake_finds_cann_in_each_install_layout(tmp_path, layout):
    cann = _stub_cann(tmp_path / "cann", layout)
    r = _probe(tmp_path, cann)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    kdir, ldir, _ = LAYOUTS[layout]
    assert _probed(r.stdout, "kernel_cmake") == str(cann / kdir)
    libs = _probed(r.stdout, "libs").split(";")
    for lib in REQUIRED_LIBS + ("mmpa", "c_sec"):
        assert str(cann / ldir / f"lib{lib}.so") in libs, (lib, libs)
    assert libs[-2:] == ["dl", "m"]


@needs_cmake
def test_cmake_names_a_missing_cann_library(tmp_path):
    cann = _stub_cann(tmp_path / "cann", "toolkit", missing="graph_base")
    r = _probe(tmp_path, cann)
    assert r.returncode != 0 and "CANN library libgraph_base not found" in r.stderr
