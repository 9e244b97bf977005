"""Layer-k maps: the k of every attention layer (0 = dense layer), from a default k and
``--layer-k`` overrides, and their compact text form."""

from __future__ import annotations

from typing import Optional, Sequence

DENSE = 0  # layer k value meaning "not thresholded" (every row dense)

#: The ``--layer-k`` overrides calibration uses unless told otherwise (the paper keeps
#: layers 0 and 1 at a higher k).
DEFAULT_LAYER_K = "0:256,1:256"

LayerK = list[int]  # k per layer; DENSE (0) keeps the layer dense


def parse_layer_k(spec: Optional[str], k: int, num_layers: int) -> LayerK:
    """Build the per-layer k map from a default k and an override string.

    Parameters
    ----------
    spec : str or None
        Comma-separated ``layer:value`` pairs, e.g. ``"0:256,1:256"`` or
        ``"0:dense,1:dense"``; value ``dense`` (or 0) keeps that layer dense. Negative
        layer indices count from the end. None or "" means no override.
    k : int
        The k of every layer not named in ``spec``; must be >= 1.
    num_layers : int
        Number of attention layers of the model.

    Returns
    -------
    list of int
        ``num_layers`` values; :data:`DENSE` (0) marks a dense layer.

    Raises
    ------
    ValueError
        k < 1, a malformed pair, a layer index out of range, a value < 0, or a layer
        named twice (also as ``-1`` and ``num_layers - 1``).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    out = [k] * num_layers
    seen: dict[int, str] = {}
    for layer, val, part in layer_k_overrides(spec):
        if not -num_layers <= layer < num_layers:
            raise ValueError(f"--layer-k layer must lie in [0, {num_layers - 1}], got {layer} in {part!r}")
        idx = layer % num_layers
        if idx in seen:
            raise ValueError(f"--layer-k names layer {idx} twice ({seen[idx]!r} and {part!r})")
        seen[idx] = part
        out[idx] = val
    return out


def base_k(layer_k: Sequence[int]) -> int:
    """The k of a layer-k map: its most common non-dense value (the others are
    ``--layer-k`` overrides); 0 when every layer is dense."""
    ks = [k for k in layer_k if k != DENSE]
    return max(set(ks), key=ks.count) if ks else 0


def layer_k_overrides(spec: Optional[str]) -> list[tuple[int, int, str]]:
    """Parse the syntax of a ``--layer-k`` string without knowing the model.

    Parameters
    ----------
    spec : str or None
        See :func:`parse_layer_k`.

    Returns
    -------
    list of (layer, value, text)
        Layer index as written (may be negative), k value (:data:`DENSE` for "dense" or
        0) and the entry's text, in order.

    Raises
    ------
    ValueError
        A malformed pair, a non-integer layer or value, a value < 0, or a layer index
        written twice.
    """
    out: list[tuple[int, int, str]] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        if ":" not in part:
            raise ValueError(f"--layer-k entries must look like LAYER:K or LAYER:dense, got {part!r}")
        layer_s, val_s = (x.strip() for x in part.split(":", 1))
        try:
            layer = int(layer_s)
        except ValueError:
            raise ValueError(f"--layer-k layer must be an integer, got {layer_s!r} in {part!r}") from None
        if val_s.lower() == "dense":
            val = DENSE
        else:
            try:
                val = int(val_s)
            except ValueError:
                raise ValueError(
                    f"--layer-k value must be an integer >= 1, or 0 / 'dense', got {val_s!r} in {part!r}"
                ) from None
            if val < 0:
                raise ValueError(f"--layer-k value must be >= 1, or 0 / 'dense', got {val} in {part!r}")
        if any(layer == prev for prev, _, _ in out):
            raise ValueError(f"--layer-k names layer {layer} twice in {spec!r}")
        out.append((layer, val, part))
    return out


def format_layer_k(layer_k: Sequence[int]) -> str:
    """Compact text form of a layer-k map, e.g. ``"0-1:dense, 2-29:16"``."""
    parts, start = [], 0
    for i in range(1, len(layer_k) + 1):
        if i == len(layer_k) or layer_k[i] != layer_k[start]:
            val = "dense" if layer_k[start] == DENSE else str(layer_k[start])
            rng = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            parts.append(f"{rng}:{val}")
            start = i
    return ", ".join(parts)
