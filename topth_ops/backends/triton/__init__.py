"""Backend ``triton``: the Triton kernels of :mod:`topth_ops.cuda_kernels` on CUDA, and
their host side: :mod:`.launch` (tile and split heuristics, the launcher) and
:mod:`.occupancy` (occupancy and wave arithmetic). Importing this package does not import
Triton; :mod:`.launch` does."""
