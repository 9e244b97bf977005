"""Ascend C kernel of the thresholded decode attention, its host tiling, the CPU model of
the Ascend C API it is verified on, and the CANN/torch_npu build (docs/ascendc.md).

Compiled modules (built by the package install, see setup.py):

* ``_ascendc_cpu``: the kernel built with g++ against the CPU model (backend ``ascendc-cpu``);
* ``_ascendc_npu``: the kernel built with CANN for Atlas A2 / Ascend 910B plus a torch_npu
  launcher (backend ``ascendc``), only when ASCEND_HOME_PATH was set at build time.

Nothing here is imported by ``import topth_ops``: the backends load these modules lazily.
"""


def cpu_model_extension():
    """The compiled module ``_ascendc_cpu`` (the kernel on the CPU model of Ascend C).

    Raises
    ------
    ImportError
        The package install did not build it.
    """
    from . import _ascendc_cpu

    return _ascendc_cpu


def npu_extension():
    """The compiled module ``_ascendc_npu`` (the kernel built with CANN, docs/ascendc.md).

    Raises
    ------
    ImportError
        Not built: ASCEND_HOME_PATH, torch and torch_npu were not all there at install time.
    """
    from . import _ascendc_npu

    return _ascendc_npu
