"""Writing threshold files (format version 2, atomically; docs/thresholds.md)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .format import FORMAT, FORMAT_VERSION, ThresholdFileError, attention_config_of, describe_config
from .length_model import LengthModel
from .validate import validate_set


def _model_tensor(m: LengthModel) -> torch.Tensor:
    return torch.from_numpy(np.stack([m.anchor_n, m.anchor_value, m.slope]).astype(np.float64))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_threshold_sets(path: Union[str, os.PathLike], sets: Sequence) -> Path:
    """Validate and write threshold sets to one file atomically (temporary file + fsync +
    rename).

    Parameters
    ----------
    path : str or os.PathLike
        Destination ``.safetensors`` file; missing parent folders are created, an existing
        file is replaced. On success each set's ``path`` and ``set_index`` are set.
    sets : sequence of ThresholdSet
        At least one; all for the same model (attention config and name), placement and
        selection mode, so that the op can take them as one 3-D thresholds tensor.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ThresholdFileError
        A set is inconsistent (same checks as loading), or the sets disagree in model,
        placement or selection.
    ValueError
        No sets, or ``path`` names a directory.
    OSError
        The file cannot be written (the message names ``path``); no partial file is left.
    """
    from safetensors.torch import save_file

    from .. import __version__

    sets = list(sets)
    if not sets:
        raise ValueError("save_threshold_sets needs at least one threshold set")
    first = sets[0]
    for i, ts in enumerate(sets):
        validate_set(ts, where=f"threshold set {i} to save")
        for f in ("model_name", "placement", "selection"):
            if getattr(ts, f) != getattr(first, f):
                raise ThresholdFileError(f"threshold sets of one file must share the {f}: set 0 has "
                                         f"{getattr(first, f)!r}, set {i} {getattr(ts, f)!r}")
        if ts.fingerprint != first.fingerprint:
            raise ThresholdFileError("threshold sets of one file must share the attention config: set 0 is "
                                     f"({describe_config(first.attention_config)}), set {i} "
                                     f"({describe_config(ts.attention_config)})")
    path = Path(path)
    if not path.name or path.is_dir():
        raise ValueError(f"threshold file path {str(path)!r} names a directory; expected a file "
                         "path such as th_k16.safetensors")
    tensors = {}
    for i, ts in enumerate(sets):
        Rc = ts.calibrated_row_ids
        tensors[f"set{i}.thresholds"] = ts.thresholds[..., :Rc].detach().to("cpu", torch.float32).contiguous()
        tensors[f"set{i}.sample_counts"] = ts.counts.detach().to("cpu", torch.int64).contiguous()
        if ts.sdc_table is not None:
            tensors[f"set{i}.sdc_table"] = ts.sdc_table[..., :Rc].detach().to("cpu", torch.float32).contiguous()
        if ts.length_model is not None:
            tensors[f"set{i}.length_model"] = _model_tensor(ts.length_model)
        if ts.sdc_length_model is not None:
            tensors[f"set{i}.sdc_length_model"] = _model_tensor(ts.sdc_length_model)
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "model_name": first.model_name,
        "attention_config": json.dumps(attention_config_of(first.attention_config), sort_keys=True),
        "attention_fingerprint": first.fingerprint,
        "placement": first.placement,
        "selection": first.selection,
        "num_sets": str(len(sets)),
        "sets": json.dumps([ts.set_metadata() for ts in sets]),
        "created_by": f"topth-ops {__version__}",
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, f"cannot write threshold file {str(path)!r}: {e.strerror}") from None
    os.close(fd)
    # sets that share a tensor (one made from another with dataclasses.replace) are written
    # as separate copies: safetensors refuses tensors that share memory
    seen: set = set()
    for name, t in tensors.items():
        if t.untyped_storage().data_ptr() in seen:
            tensors[name] = t.clone()
        seen.add(tensors[name].untyped_storage().data_ptr())
    try:
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; follow the umask like open()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write threshold file {str(path)!r}: {e.strerror}") from None
        raise
    for i, ts in enumerate(sets):
        ts.path, ts.set_index = str(path), i
    return path


def sets_file_path(template: str, k: Optional[int], placement: str, multi_p: bool, selection: str = "head",
                   multi_s: bool = False, flag: str = "--out") -> str:
    """The file of one (k, placement, selection) from an output name template (``--out`` of
    ``topth-ops calibrate``): ``{placement}`` / ``{selection}`` are required when several are
    written (``multi_p`` / ``multi_s``, ValueError otherwise), ``{k}`` gives one file per k;
    k None: the file of all k's sets. ``flag`` names the template in messages."""
    if multi_p and "{placement}" not in template:
        raise ValueError(f"{flag} {template!r} must contain {{placement}} with both placements")
    if multi_s and "{selection}" not in template:
        raise ValueError(f"{flag} {template!r} must contain {{selection}} with both selections")
    out = template.replace("{placement}", placement).replace("{selection}", selection)
    return out if k is None else out.replace("{k}", str(k))
