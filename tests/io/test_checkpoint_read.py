"""Crafted checkpoints run nothing: the pickles they carry are refused, and a control shows they are live."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from mcore_rl.io.checkpoint_read import (
    RestrictedUnpickler,
    check_common_pt,
    read_dcp_metadata,
    safe_dcp_loading,
)
from mcore_rl.io.errors import UnsafeInputError


class _CreatesFile:
    """Unpickling this creates ``path``: the proof that a pickle ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _real_checkpoint(folder: str) -> None:
    """A small genuine DCP checkpoint: a tensor and a non-tensor object (stored as bytes, like megatron's
    ShardedObjects)."""
    _save(folder, {"w": torch.arange(6.0).reshape(2, 3), "obj": [None, {"step": 3}]})


def _save(folder: str, state: dict) -> None:
    planner = DefaultSavePlanner(flatten_state_dict=False)  # keeps "obj" one object, as megatron's planner
    dcp.save(state, checkpoint_id=folder, no_dist=True, planner=planner)


def _load(folder: str) -> dict:
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    dcp.load({"w": torch.zeros(2, 3), "obj": []}, checkpoint_id=folder, no_dist=True, planner=planner)
    return planner.state_dict


def test_a_genuine_checkpoint_reads_through_the_safe_path(tmp_path):
    _real_checkpoint(str(tmp_path))
    metadata = read_dcp_metadata(str(tmp_path))
    assert sorted(metadata.state_dict_metadata) == ["obj", "w"]
    with safe_dcp_loading():
        state = _load(str(tmp_path))
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3)) and state["obj"] == [None, {"step": 3}]


def test_crafted_metadata_runs_nothing(tmp_path):
    _real_checkpoint(str(tmp_path))
    ran = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_CreatesFile(str(ran))))
    with pytest.raises(UnsafeInputError, match=r"\.metadata: refers to io\.open"):
        read_dcp_metadata(str(tmp_path))
    # torch's own reader, patched for the block (dcp.load reports a failed metadata read in its own words)
    with pytest.raises(BaseException, match=r"refers to io\.open"), safe_dcp_loading():
        _load(str(tmp_path))
    assert not ran.exists()
    # Control: torch's reader outside the block does run it (the test would fail without the defence).
    with pytest.raises(BaseException):  # noqa: B017 (whatever torch makes of the file object it got)
        _load(str(tmp_path))
    assert ran.exists()


def test_crafted_checkpoint_object_runs_nothing(tmp_path):
    ran = tmp_path / "ran"
    _save(str(tmp_path), {"w": torch.ones(2, 3), "obj": _CreatesFile(str(ran))})
    with pytest.raises(UnsafeInputError, match=r"checkpoint object obj.*io\.open"), safe_dcp_loading():
        _load(str(tmp_path))
    assert not ran.exists()
    _load(str(tmp_path))  # control: torch's DefaultLoadPlanner loads objects with weights_only=False
    assert ran.exists()


def test_the_allow_list_is_the_format_not_a_module(tmp_path):
    for module, name in [("os", "system"), ("builtins", "eval"), ("torch", "load"), ("subprocess", "Popen")]:
        with pytest.raises(UnsafeInputError, match=f"{module}.{name}"):
            RestrictedUnpickler(io.BytesIO(b""), "x").find_class(module, name)
    assert RestrictedUnpickler(io.BytesIO(b""), "x").find_class("torch", "bfloat16") is torch.bfloat16


def test_common_pt_loads_weights_only(tmp_path):
    torch.save({"a": torch.ones(1)}, tmp_path / "common.pt")
    check_common_pt(str(tmp_path))
    ran = tmp_path / "ran"
    torch.save(_CreatesFile(str(ran)), tmp_path / "common.pt")
    with pytest.raises(UnsafeInputError, match=r"common\.pt"):
        check_common_pt(str(tmp_path))
    assert not ran.exists()
    os.remove(tmp_path / "common.pt")
    check_common_pt(str(tmp_path))  # optional file
