"""The SDC codes the Triton kernels take as the ``SDC`` constexpr (the host passes
``topth_ops.codes.Sdc``; tests compare the two)."""

import triton.language as tl

SDC_NONE = tl.constexpr(0)
SDC_EXACT = tl.constexpr(1)
SDC_EXP_THRESHOLD = tl.constexpr(2)
SDC_OFFLINE = tl.constexpr(3)
