"""Threshold sets and threshold files (the file format is docs/thresholds.md).

Modules, each importing only the ones above it in this list:

- :mod:`.layer_k`: layer-k maps (k per layer, ``DENSE`` = 0 for a dense layer);
- :mod:`.format`: format constants, :class:`ThresholdFileError`, the attention config of a model;
- :mod:`.length_model`: theta as a function of the row id beyond the calibrated row ids;
- :mod:`.tables`: completing a table over row ids (unsampled columns, rows n <= k);
- :mod:`.validate`: checks of a set and the extension of its tables;
- :mod:`.save`: writing files; :mod:`.sets`: the :class:`ThresholdSet` type;
- :mod:`.load`: reading files; :mod:`.reference`: importing the paper code's text files.
"""

from .format import (
                     ESTIMATORS,
                     FORMAT,
                     FORMAT_VERSION,
                     MAX_ROW_IDS,
                     MODEL_NAME_KEY,
                     ThresholdFileError,
                     attention_config_of,
                     default_extend_to,
                     describe_config,
                     exported_model_name,
                     fingerprint,
)
from .layer_k import DEFAULT_LAYER_K, DENSE, LayerK, base_k, format_layer_k, layer_k_overrides, parse_layer_k
from .length_model import (
                     DOMAINS,
                     FEATURES,
                     THRESHOLD_FEATURE,
                     LengthModel,
                     constant_table_model,
                     feature_of,
                     fit_length_model,
)
from .load import as_index, load_threshold_sets, load_thresholds, pick_set
from .reference import import_reference_text
from .save import save_threshold_sets
from .sets import ThresholdSet, stack_sets
from .tables import dense_rows, fill_unsampled
from .validate import extend_sdc, extend_table, validate_set

__all__ = ["DEFAULT_LAYER_K", "DENSE", "DOMAINS", "ESTIMATORS", "FEATURES", "FORMAT", "FORMAT_VERSION", "MAX_ROW_IDS",
           "MODEL_NAME_KEY",
           "THRESHOLD_FEATURE",
           "LayerK", "LengthModel", "ThresholdFileError", "ThresholdSet", "as_index", "attention_config_of", "base_k",
           "default_extend_to", "exported_model_name",
           "constant_table_model", "dense_rows", "describe_config", "extend_sdc", "extend_table", "feature_of",
           "fill_unsampled", "fingerprint", "fit_length_model", "format_layer_k", "import_reference_text",
           "layer_k_overrides", "load_threshold_sets", "load_thresholds", "parse_layer_k", "pick_set",
           "save_threshold_sets", "stack_sets", "validate_set"]
