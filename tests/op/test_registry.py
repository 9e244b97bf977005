"""Backend registry: selection order, explicit choice, environment variable, errors, logging."""

import logging

import pytest
import torch

import topth_ops
from topth_ops.backends.torch_ref import TorchBackend
from topth_ops.contract import make_inputs
from topth_ops import registry
from topth_ops.registry import (
    Backend,
    get_backend,
    list_backends,
    priority,
    register_backend,
    select_backend,
    unregister_backend,
)


def _inputs(dtype=torch.float32, head_dim=16):
    q = torch.randn(2, 4, head_dim, dtype=dtype)
    k = torch.randn(2, 2, 8, head_dim, dtype=dtype)
    return make_inputs(q, k, k.clone(), torch.tensor([8, 3]), torch.zeros(4, 8))


class _Never(Backend):
    name = "test-never"
    device_type = "cpu"

    def unavailable_reasons(self):
        return ["needs the imaginary accelerator"]


class _Fp16Only(TorchBackend):
    name = "test-fp16-only"
    device_type = "cpu"
    dtypes = (torch.float16,)


@pytest.fixture(scope="module", autouse=True)
def _register():
    register_backend(_Never(), priority=0)
    register_backend(_Fp16Only(), priority=0)
    yield
    unregister_backend("test-never")
    unregister_backend("test-fp16-only")
    assert "test-never" not in priority("cpu")


def _cpu_default() -> str:
    """The compiled cpu kernel leads the CPU order; torch runs when it is not built."""
    return "cpu" if get_backend("cpu").is_available() else "torch"


def test_builtin_backends_are_listed_and_cpu_default_on_cpu(monkeypatch):
    monkeypatch.delenv("TOPTH_BACKEND", raising=False)
    assert {"torch", "cpu"} <= {b.name for b in list_backends()}
    assert priority("cpu")[-2:] == ["cpu", "torch"]
    assert select_backend(_inputs()).name == _cpu_default()


def test_automatic_selection_skips_with_logged_reasons(monkeypatch, caplog):
    monkeypatch.delenv("TOPTH_BACKEND", raising=False)
    registry._logged.clear()  # the message is logged once per process
    with caplog.at_level(logging.WARNING, logger="topth_ops"):
        b = select_backend(_inputs(torch.float32))
    assert b.name == _cpu_default()
    text = caplog.text
    assert "test-never" in text and "imaginary accelerator" in text
    assert "test-fp16-only" in text and "float32 not supported" in text
    # both were inserted at position 0, so the fp16-only one now leads the cpu order
    assert priority("cpu")[:2] == ["test-fp16-only", "test-never"]
    assert select_backend(_inputs(torch.float16)).name == "test-fp16-only"


def test_explicit_choice_that_cannot_run_raises_with_reasons():
    with pytest.raises(NotImplementedError, match="imaginary accelerator"):
        select_backend(_inputs(), "test-never")
    with pytest.raises(NotImplementedError, match="float32 not supported"):
        topth_ops.decode_attention(*_args(), backend="test-fp16-only")


def _args():
    i = _inputs()
    return i.query, i.key_cache, i.value_cache, i.seq_lens, i.thresholds


def test_environment_variable_selects_and_argument_wins(monkeypatch):
    monkeypatch.setenv("TOPTH_BACKEND", "test-never")
    with pytest.raises(NotImplementedError, match="TOPTH_BACKEND='test-never'"):
        topth_ops.decode_attention(*_args())
    out = topth_ops.decode_attention(*_args(), backend="torch")  # the argument beats the env
    assert out.shape == (2, 4, 16)


def test_unknown_backend_lists_names():
    with pytest.raises(ValueError, match="backend must be one of") as e:
        get_backend("cuda-magic")
    assert "torch" in str(e.value)


def test_nothing_qualifies_lists_inputs_and_every_backend(monkeypatch):
    monkeypatch.delenv("TOPTH_BACKEND", raising=False)
    i = _inputs(head_dim=16)
    monkeypatch.setattr(TorchBackend, "input_reasons", lambda self, inputs: ["disabled in this test"])
    monkeypatch.setattr(_Fp16Only, "input_reasons", lambda self, inputs: ["disabled in this test"])
    monkeypatch.setattr(type(get_backend("cpu")), "input_reasons", lambda self, inputs: ["disabled in this test"])
    with pytest.raises(NotImplementedError) as e:
        select_backend(i)
    msg = str(e.value)
    assert "query [2, 4, 16] float32" in msg
    for name in ("cpu", "torch", "test-never", "test-fp16-only"):
        assert f"  {name}:" in msg


def test_register_rejects_duplicates_and_empty_names():
    with pytest.raises(ValueError, match="already registered"):
        register_backend(TorchBackend())
    with pytest.raises(ValueError, match="non-empty"):
        register_backend(Backend())


def test_import_needs_no_triton_or_device_runtime():
    import subprocess
    import sys

    code = ("import sys, topth_ops; topth_ops.list_backends(); "
            "bad = [m for m in ('triton', 'torch_npu') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_junk_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv("TOPTH_BACKEND", "junk")
    with pytest.raises(ValueError, match="environment variable TOPTH_BACKEND='junk' names no backend"):
        topth_ops.decode_attention(*_args())


def test_any_device_backend_with_priority_joins_every_order(monkeypatch):
    monkeypatch.delenv("TOPTH_BACKEND", raising=False)

    class Mine(TorchBackend):
        name = "test-mine-any"

    register_backend(Mine(), priority=0)
    try:
        for dev in ("cpu", "cuda", "npu", "some-new-device"):
            assert priority(dev)[0] == "test-mine-any"
        assert select_backend(_inputs()).name == "test-mine-any"
    finally:
        unregister_backend("test-mine-any")
    for dev in ("cpu", "cuda", "npu", "some-new-device"):
        assert "test-mine-any" not in priority(dev)
