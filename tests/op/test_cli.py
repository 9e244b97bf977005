"""Command-line entry points: info, conformance, demo (in-process and as a console script)."""

import json
import shutil
import subprocess
import sys

import pytest

from topth_ops.cli import main


def test_info_lists_every_backend_with_availability(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    from topth_ops import list_backends

    for b in list_backends():
        assert b.name in text
    assert "automatic order on cpu" in text


def test_python_m_info_runs_without_accelerators():
    r = subprocess.run([sys.executable, "-m", "topth_ops.info"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout


def test_console_script():
    assert shutil.which("topth-ops"), "the topth-ops console script is not installed (pip install -e .)"
    r = subprocess.run(["topth-ops", "info"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_conformance_cli_passes_for_torch_and_writes_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    code = main(["conformance", "--backend", "torch", "--shapes", "quick", "--dtypes", "float32",
                 "--rules", "pre_softmax,strict_tie,errors", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "PASS: 3 passed, 0 failed" in text
    rows = json.loads(out.read_text())
    assert {r["rule"] for r in rows} == {"pre_softmax", "strict_tie", "errors"}


def test_conformance_cli_exits_nonzero_on_a_broken_backend(capsys):
    import torch

    from topth_ops import register_backend, unregister_backend
    from topth_ops.backends.torch_ref import TorchBackend

    class Broken(TorchBackend):
        name = "test-broken"

        def forward(self, inputs, out, stats):
            super().forward(inputs, out, stats)
            out.add_(torch.ones_like(out))  # wrong output

    register_backend(Broken())
    try:
        code = main(["conformance", "--backend", "test-broken", "--shapes", "quick",
                     "--dtypes", "float32", "--rules", "post_softmax"])
    finally:
        unregister_backend("test-broken")
    text = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in text and "worst at" in text


@pytest.mark.parametrize("argv,needle", [
    (["conformance", "--backend", "nope"], "backend must be one of"),
    (["conformance"], "--backend is required"),
    (["conformance", "--backend", "torch", "--dtypes", "float32,float64"], "dtypes must be"),
    (["conformance", "--backend", "torch", "--dtypes", ""], "dtypes must be"),
    (["conformance", "--backend", "torch", "--rules", "bogus"], "rules must be"),
    (["conformance", "--backend", "torch", "--device", "no-such-device"], "not usable"),
    (["demo", "--backend", "bogus"], "backend must be one of"),
    (["demo", "--k", "500", "--seq-len", "100"], "--k must be < --seq-len"),
    (["demo", "--q-heads", "8", "--kv-heads", "3"], "multiple of --kv-heads"),
    (["demo", "--seq-len", "0"], "--seq-len must be >= 1"),
])
def test_bad_flags_give_one_line_errors(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_conformance_list_needs_no_backend(capsys):
    assert main(["conformance", "--list"]) == 0
    assert "strict_tie" in capsys.readouterr().out


def test_unavailable_backend_is_refused_with_its_reasons(capsys, monkeypatch):
    from topth_ops.backends.torch_ref import TorchBackend

    monkeypatch.setattr(TorchBackend, "unavailable_reasons", lambda self: ["switched off in this test"])
    assert main(["conformance", "--backend", "torch"]) == 2
    assert "switched off in this test" in capsys.readouterr().err


def test_demo_prints_error_and_v_rows(capsys):
    assert main(["demo", "--seq-len", "256", "--batch", "2", "--k", "16"]) == 0
    text = capsys.readouterr().out
    assert "V rows read" in text and "rel. L2 error" in text
