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


@pytest.mark.skipif(shutil.which("topth-ops") is None, reason="console script not installed")
def test_console_script():
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


def test_conformance_cli_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        main(["conformance", "--backend", "nope"])


def test_demo_prints_error_and_v_rows(capsys):
    assert main(["demo", "--seq-len", "256", "--batch", "2", "--k", "16"]) == 0
    text = capsys.readouterr().out
    assert "V rows read" in text and "rel. L2 error" in text
