"""Plain values survive encode -> JSON -> decode exactly, and need no pickle."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from gpusnap.errors import CheckpointError
from gpusnap.state import decode_plain, encode_plain, is_plain


def roundtrip(value: object) -> object:
    node = json.loads(json.dumps(encode_plain(value, "k", False), allow_nan=False))  # strict JSON
    return decode_plain(node, "k", False)


def bits(x: float) -> bytes:
    return struct.pack(">d", x)


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -1, 2**200, -(3**150), 1.5, 1e-310, 5e-324, 1.7976931348623157e308,
        "", "héllo\x00✓", b"", b"\x00\xff" * 10,
        torch.float8_e4m3fn, torch.bfloat16, torch.bool, torch.device("cpu"), torch.device("cuda", 3),
        torch.Size([]), torch.Size([2, 0, 3]),
    ],
)
def test_scalar_roundtrip_keeps_value_and_type(value: object) -> None:
    out = roundtrip(value)
    assert type(out) is type(value)
    assert out == value


@pytest.mark.parametrize("value", [0.0, -0.0, math.inf, -math.inf, 1e-300, -2.5])
def test_float_bits_survive(value: float) -> None:
    out = roundtrip(value)
    assert type(out) is float and bits(out) == bits(value)


def test_nan_payload_and_sign_survive() -> None:
    odd_nan = struct.unpack(">d", bytes.fromhex("fff0000000000123"))[0]
    for value in (math.nan, -math.nan, odd_nan):
        assert bits(roundtrip(value)) == bits(value)


def test_negative_zero_not_stored_as_plain_json_number() -> None:
    assert encode_plain(-0.0, "k", False)["t"] == "float"
    assert encode_plain(0.0, "k", False) == {"t": "v", "v": 0.0}


def test_containers_nested_with_any_plain_keys() -> None:
    value = {
        0: {"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1, 2]},
        -7: [None, -0.0, math.inf],
        2**70: "big key",
        (1, "a"): b"tuple key",
        None: torch.float16,
        "nested": [[], (), {}, [(1,), {"x": [torch.Size([1])]}]],
    }
    out = roundtrip(value)
    assert repr(out) == repr(value)
    assert list(out) == list(value)  # order kept
    assert type(out[0]["betas"]) is tuple and type(out[0]["params"]) is list
    assert bits(out[-7][1]) == bits(-0.0)


def test_is_plain() -> None:
    assert is_plain({1: [b"x", (None, torch.int8, torch.Size([2]))]})
    assert not is_plain(torch.zeros(1))
    assert not is_plain([object()])
    assert not is_plain({"k": {1: bytearray(b"x")}})
    cyclic: list[object] = []
    cyclic.append(cyclic)
    assert not is_plain(cyclic)


def test_unsupported_value_names_path_type_and_fix() -> None:
    class Thing:
        pass

    with pytest.raises(CheckpointError) as err:
        encode_plain({"a": [1, Thing()]}, "opts", False)
    message = str(err.value)
    assert "opts/a/1" in message and "Thing" in message
    assert "Stateful" in message and "allow_pickle=True" in message


def test_subclasses_of_plain_types_are_not_silently_converted() -> None:
    import enum

    class Color(enum.IntEnum):
        RED = 1

    with pytest.raises(CheckpointError, match="Color"):
        encode_plain(Color.RED, "c", False)


def test_cycle_is_an_error() -> None:
    d: dict[str, object] = {}
    d["self"] = d
    with pytest.raises(CheckpointError, match="cycle"):
        encode_plain(d, "d", False)


def test_pickle_opt_in_roundtrip() -> None:
    value = {"frac": __import__("fractions").Fraction(1, 3)}
    node = encode_plain(value, "k", True)
    assert node["items"][0][1]["t"] == "pickle"
    assert decode_plain(json.loads(json.dumps(node)), "k", True) == value


@pytest.mark.parametrize(
    "node",
    [
        {"t": "nope"},
        {"v": 1},
        {"t": "tensor", "storage": 0},
        {"t": "v", "v": [1, 2]},
        {"t": "dtype", "v": "not_a_dtype"},
        {"t": "dtype", "v": "nn"},
        {"t": "bytes", "v": "!!!"},
        {"t": "size", "v": [1.5]},
        {"t": "dict", "items": [[{"t": "list", "items": []}, {"t": "v", "v": 1}]]},
        {"t": "list"},
        "not a node",
    ],
)
def test_malformed_or_unknown_nodes_raise_checkpoint_error(node: object) -> None:
    with pytest.raises(CheckpointError):
        decode_plain(node, "k", False)  # type: ignore[arg-type]
