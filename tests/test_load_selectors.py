"""``gpusnap.load(keys=...)`` selectors: every key can be named, none ambiguously.

Strings are dotted paths matched against the decoded keys (a key may hold ``.`` or ``/``);
tuples of keys compare by value and exact type; a string naming several entries is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from restore_support import tiny_config

import gpusnap
from gpusnap.restore.key_select import AmbiguousKeyError
from gpusnap.restore.template_free import UnknownKeyError


def _save(root: Path, state: dict[str, Any]) -> None:
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save(state, blocking=True).wait()


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    _save(tmp_path, {
        "n": {1: torch.full((2,), 1.0), "1": torch.full((2,), 2.0), "x": torch.zeros(1)},
        "a/b": torch.full((3,), 3.0),
        "a": {"b": torch.full((3,), 4.0)},
        "c.d": torch.full((1,), 5.0),
        "t": {("x", 1): torch.full((1,), 6.0), 2.5: torch.full((1,), 7.0)},
        "step": 3,
    })
    return tmp_path


def test_empty_keys_is_a_value_error_not_an_empty_dict(root: Path) -> None:
    for keys in ([], ()):
        with pytest.raises(ValueError, match="selects nothing"):
            gpusnap.load(root, keys=keys)


def test_a_top_level_key_holding_a_slash_or_a_dot_can_be_selected(root: Path) -> None:
    assert list(gpusnap.load(root, keys=["c.d"])) == ["c.d"]
    got = gpusnap.load(root, keys=[("a/b",)])
    assert list(got) == ["a/b"] and torch.equal(got["a/b"], torch.full((3,), 3.0))
    nested = gpusnap.load(root, keys=[("a", "b")])
    assert list(nested) == ["a"] and list(nested["a"]) == ["b"]
    assert torch.equal(nested["a"]["b"], torch.full((3,), 4.0))


def test_a_string_naming_two_entries_is_refused_with_both_named(root: Path) -> None:
    for key, named in (("n.1", ["('n', 1)", "('n', '1')"]), ("a/b", ["('a/b',)", "('a', 'b')"])):
        with pytest.raises(AmbiguousKeyError) as caught:
            gpusnap.load(root, keys=[key])
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, gpusnap.CheckpointError)
        for text in named:
            assert text in str(caught.value)
        assert "tuple" in str(caught.value)


def test_tuples_tell_int_from_str_keys(root: Path) -> None:
    as_int = gpusnap.load(root, keys=[("n", 1)])["n"]
    as_str = gpusnap.load(root, keys=[("n", "1")])["n"]
    assert list(as_int) == [1] and torch.equal(as_int[1], torch.full((2,), 1.0))
    assert list(as_str) == ["1"] and torch.equal(as_str["1"], torch.full((2,), 2.0))
    with pytest.raises(UnknownKeyError):
        gpusnap.load(root, keys=[("n", True)])  # True == 1, but it is not the key 1


def test_keys_of_other_types_are_named_by_tuples(root: Path) -> None:
    got = gpusnap.load(root, keys=[("t", ("x", 1)), ("t", 2.5)])["t"]
    assert set(got) == {("x", 1), 2.5}
    assert torch.equal(got[("x", 1)], torch.full((1,), 6.0))


def test_unambiguous_strings_still_select(root: Path) -> None:
    got = gpusnap.load(root, keys=["n.x", "step"])
    assert list(got) == ["n", "step"] and list(got["n"]) == ["x"] and got["step"] == 3
    dotted = gpusnap.load(root, keys="a.b")  # "a/b" (a key of its own) is not "a.b"
    assert list(dotted) == ["a"] and torch.equal(dotted["a"]["b"], torch.full((3,), 4.0))


@pytest.mark.parametrize("bad", [[""], ["./"], [()], [3], [None]])
def test_malformed_selectors_are_value_errors(root: Path, bad: list[Any]) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        gpusnap.load(root, keys=bad)
