"""Plain values <-> JSON-able tree nodes, with no code execution on the way back.

Plain values (None, bool, int, float, str, bytes, ``torch.dtype``, ``torch.device``,
``torch.Size`` and dict/list/tuple of those) are encoded natively, so a manifest can be read
without unpickling anything (DESIGN.md invariant 6). Anything else needs ``allow_pickle=True``
both when saving and when loading; a ``pickle`` node met with ``allow_pickle=False`` is
refused before its bytes are even decoded.

Node kinds (``{"t": kind, ...}``, see docs/architecture.md): ``v`` (JSON scalar), ``float``
(non-finite and negative zero, as text; NaN also keeps its exact bits), ``bytes`` (base64),
``dtype``, ``device``, ``size``, ``dict`` (``items``: ``[[key node, value node], ...]``),
``list`` and ``tuple`` (``items``), ``pickle`` (base64).

>>> decode_plain(encode_plain({1: (b"x", -0.0)}, "k", False), "k", False)
{1: (b'x', -0.0)}
"""

from __future__ import annotations

import base64
import binascii
import math
import pickle
import struct
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = [
    "PLAIN_KINDS",
    "encode_plain",
    "decode_plain",
    "is_plain",
    "dtype_name",
    "dtype_from_name",
    "dotted_path",
    "join_path",
    "type_name",
]

PLAIN_KINDS = frozenset({"v", "float", "bytes", "dtype", "device", "size", "dict", "list", "tuple", "pickle"})
"""Node kinds that :func:`decode_plain` understands (everything but tensors and objects)."""

# Exact types only: a subclass (IntEnum, numpy.float64, namedtuple...) would come back as its
# base type, silently changing what the program sees after a restore.
_SCALARS = (type(None), bool, int, float, str)
_NAN_TEXT = "nan"


def join_path(path: str, key: object) -> str:
    """Key path of ``key`` under ``path``: keys joined by ``/`` (``optim/state/0/exp_avg``)."""
    return f"{path}/{key}" if path else str(key)


def dotted_path(path: str, key: object) -> str:
    """Dotted key path of ``key`` under ``path`` (``/`` or ``.`` joined), as torch's
    ``missing_keys`` and ``gpusnap.load(keys=...)`` write them: ``model.0.weight``."""
    return f"{path.replace('/', '.')}.{key}" if path else str(key)


def type_name(value: object) -> str:
    """Qualified class name of ``value``, for error messages and ``stateful`` nodes."""
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``: the name the manifest records."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object, path: str = "") -> torch.dtype:
    """Inverse of :func:`dtype_name`; a name this torch does not know is a CheckpointError."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{path or '<root>'}: unknown dtype {name!r} (not a dtype of torch {torch.__version__})")
    return dtype


def is_plain(value: Any) -> bool:
    """True when ``value`` can be stored without pickle (see module docstring)."""
    return _is_plain(value, set())


def _is_plain(value: Any, active: set[int]) -> bool:
    if type(value) in _SCALARS or type(value) is bytes:
        return True
    if isinstance(value, (torch.dtype, torch.device)) or type(value) is torch.Size:
        return True
    if type(value) in (list, tuple) or isinstance(value, dict):
        if id(value) in active:
            return False
        active.add(id(value))
        try:
            if isinstance(value, dict):
                return all(_is_plain(k, active) and _is_plain(v, active) for k, v in value.items())
            return all(_is_plain(v, active) for v in value)
        finally:
            active.discard(id(value))
    return False


def encode_plain(value: Any, path: str, allow_pickle: bool) -> dict[str, Any]:
    """Tree node for ``value``; ``path`` names it in errors.

    Raises CheckpointError for a value that is not plain unless ``allow_pickle`` is set,
    in which case that value (only that one, not its container) is stored as a ``pickle`` node.
    """
    return _encode(value, path, allow_pickle, set())


def _encode(value: Any, path: str, allow_pickle: bool, active: set[int]) -> dict[str, Any]:
    kind = type(value)
    if kind is float:
        return _encode_float(value)
    if kind in _SCALARS:
        return {"t": "v", "v": value}
    if kind is bytes:
        return {"t": "bytes", "v": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"t": "device", "v": str(value)}
    if kind is torch.Size:
        return {"t": "size", "v": list(value)}
    if kind in (list, tuple) or isinstance(value, dict):
        return _encode_container(value, path, allow_pickle, active)
    return _encode_other(value, path, allow_pickle)


def _encode_float(value: float) -> dict[str, Any]:
    if math.isfinite(value) and not (value == 0.0 and math.copysign(1.0, value) < 0):
        return {"t": "v", "v": value}  # repr round-trips every finite float exactly
    if math.isnan(value):
        # A NaN's sign and payload are not visible in text: keep the exact bits as well.
        return {"t": "float", "v": _NAN_TEXT, "bits": struct.pack(">d", value).hex()}
    return {"t": "float", "v": repr(value)}  # "inf", "-inf", "-0.0"


def _encode_container(value: Any, path: str, allow_pickle: bool, active: set[int]) -> dict[str, Any]:
    if id(value) in active:
        raise CheckpointError(f"{path or '<root>'}: the container refers to itself; a checkpoint cannot hold a cycle")
    active.add(id(value))
    try:
        if isinstance(value, dict):
            items = [
                [_encode_key(k, path, allow_pickle, active), _encode(v, join_path(path, k), allow_pickle, active)]
                for k, v in value.items()
            ]
            return {"t": "dict", "items": items}
        kind = "list" if type(value) is list else "tuple"
        return {"t": kind, "items": [_encode(v, join_path(path, i), allow_pickle, active) for i, v in enumerate(value)]}
    finally:
        active.discard(id(value))


def _encode_key(key: Any, path: str, allow_pickle: bool, active: set[int]) -> dict[str, Any]:
    if isinstance(key, torch.Tensor):
        raise CheckpointError(f"{path or '<root>'}: a dict key is a tensor; keys must be plain values")
    return _encode(key, join_path(path, key), allow_pickle, active)


def _encode_other(value: Any, path: str, allow_pickle: bool) -> dict[str, Any]:
    if not allow_pickle:
        raise CheckpointError(
            f"{path or '<root>'}: cannot checkpoint a value of type {type_name(value)}: it is not a tensor, "
            "nn.Module, Stateful or plain value (None, bool, int, float, str, bytes, torch.dtype, "
            "torch.device, torch.Size, dict/list/tuple of those). Make its owner Stateful "
            "(state_dict()/load_state_dict() returning such values), convert it to a plain value, "
            "or pass allow_pickle=True (restoring it will then need allow_pickle=True too)."
        )
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise CheckpointError(f"{path or '<root>'}: cannot pickle a value of type {type_name(value)}: {exc}") from exc
    return {"t": "pickle", "v": base64.b64encode(payload).decode("ascii")}


def decode_plain(node: dict[str, Any], path: str, allow_pickle: bool) -> Any:
    """Value of a plain node; never unpickles unless ``allow_pickle`` is set.

    Raises CheckpointError for malformed or unknown nodes and for refused ``pickle`` nodes.
    """
    kind = node.get("t") if isinstance(node, dict) else None
    decoder = _DECODERS.get(kind) if isinstance(kind, str) else None
    if decoder is None:
        raise CheckpointError(f"{path or '<root>'}: unknown or non-plain checkpoint node kind {kind!r}")
    try:
        return decoder(node, path, allow_pickle)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, binascii.Error, struct.error, RuntimeError) as exc:
        raise CheckpointError(f"{path or '<root>'}: malformed {kind!r} node: {exc!r}") from exc


def _decode_v(node: dict[str, Any], path: str, allow_pickle: bool) -> Any:
    value = node["v"]
    if type(value) not in _SCALARS:
        raise TypeError(f"a 'v' node holds a {type(value).__name__}")
    return value


def _decode_float(node: dict[str, Any], path: str, allow_pickle: bool) -> float:
    if "bits" in node:
        return struct.unpack(">d", bytes.fromhex(node["bits"]))[0]
    text = node["v"]
    if not isinstance(text, str):
        raise TypeError("a 'float' node holds no text")
    return float(text)


def _decode_bytes(node: dict[str, Any], path: str, allow_pickle: bool) -> bytes:
    return base64.b64decode(node["v"], validate=True)


def _decode_dtype(node: dict[str, Any], path: str, allow_pickle: bool) -> torch.dtype:
    return dtype_from_name(node["v"], path)


def _decode_device(node: dict[str, Any], path: str, allow_pickle: bool) -> torch.device:
    if not isinstance(node["v"], str):
        raise TypeError("a 'device' node holds no text")
    return torch.device(node["v"])


def _decode_size(node: dict[str, Any], path: str, allow_pickle: bool) -> torch.Size:
    dims = node["v"]
    if not isinstance(dims, list) or not all(type(d) is int for d in dims):
        raise TypeError("a 'size' node must hold a list of ints")
    return torch.Size(dims)


def _decode_dict(node: dict[str, Any], path: str, allow_pickle: bool) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key_node, value_node in node["items"]:
        key = decode_plain(key_node, path, allow_pickle)
        out[key] = decode_plain(value_node, join_path(path, key), allow_pickle)
    return out


def _decode_list(node: dict[str, Any], path: str, allow_pickle: bool) -> list[Any]:
    items = node["items"]
    if not isinstance(items, list):
        raise TypeError(f"{node['t']!r} items must be a list")
    return [decode_plain(item, join_path(path, i), allow_pickle) for i, item in enumerate(items)]


def _decode_tuple(node: dict[str, Any], path: str, allow_pickle: bool) -> tuple[Any, ...]:
    return tuple(_decode_list(node, path, allow_pickle))


def _decode_pickle(node: dict[str, Any], path: str, allow_pickle: bool) -> Any:
    if not allow_pickle:
        raise CheckpointError(
            f"{path or '<root>'}: the checkpoint stores this value with pickle; refusing to unpickle it "
            "because unpickling can run code from the checkpoint. Pass allow_pickle=True only if you "
            "trust where this checkpoint came from."
        )
    payload = base64.b64decode(node["v"], validate=True)
    try:
        return pickle.loads(payload)
    except Exception as exc:
        raise CheckpointError(f"{path or '<root>'}: cannot unpickle the stored value: {exc!r}") from exc


_DECODERS = {
    "v": _decode_v,
    "float": _decode_float,
    "bytes": _decode_bytes,
    "dtype": _decode_dtype,
    "device": _decode_device,
    "size": _decode_size,
    "dict": _decode_dict,
    "list": _decode_list,
    "tuple": _decode_tuple,
    "pickle": _decode_pickle,
}
