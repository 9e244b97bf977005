"""Threshold calibration (paper section 3.1, algorithm 1; section 3.2.1 for the SDC table)
in bounded memory. No dependency on transformers: the model integration feeds it scores.

Modules, each importing only the ones above it in this list (and :mod:`topth_ops.thresholds`):

- :mod:`.rows`: row helpers shared by the estimators (row maximum, log-normaliser, host copies);
- :mod:`.mean`: algorithm 1, mean + alpha * std of each row's (k+1)-th value per row id
  (:class:`ThresholdAccumulator`, :class:`CalibrationResult`);
- :mod:`.count`: the kept-count estimator over row-length buckets (:class:`CountAccumulator`);
- :mod:`.sdc`: the offline SDC table, a second pass at the final thresholds (:class:`SdcAccumulator`).
"""

from .count import DEFAULT_BINS, DEFAULT_BUCKETS_PER_OCTAVE, DEFAULT_ROWS_PER_OCTAVE, CountAccumulator, bucket_edges
from .mean import CalibrationResult, ThresholdAccumulator
from .rows import no_long_rows_error, row_log_z, row_max, to_host
from .sdc import SdcAccumulator

__all__ = ["DEFAULT_BINS", "DEFAULT_BUCKETS_PER_OCTAVE", "DEFAULT_ROWS_PER_OCTAVE", "CalibrationResult",
           "CountAccumulator", "SdcAccumulator", "ThresholdAccumulator", "bucket_edges", "no_long_rows_error",
           "row_log_z", "row_max", "to_host"]
