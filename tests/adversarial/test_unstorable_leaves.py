"""Exotic kinds of tensor in a saved state: each saves and restores exactly, or ``save()``
raises a ``CociError`` naming its key before anything is written (so the adapters count a failed
save and training goes on), with ``allow_torch_save`` off and on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager, CociError

pytestmark = [
    # torch's own notes on these prototype and deprecated kinds, once per process
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
]

KEY = "/model/leaf"  # the key the errors name: state["model"]["leaf"]


class SavedSubclass(torch.Tensor):
    """A tensor subclass torch.save can pickle (weights_only loading would import it)."""


def _local_subclass() -> torch.Tensor:
    class Local(torch.Tensor):  # torch.save cannot pickle a class defined in a function
        pass

    return torch.ones(3).as_subclass(Local)


def _of(dtype_name: str) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        dtype = getattr(torch, dtype_name, None)
        if dtype is None:
            pytest.skip(f"torch {torch.__version__} has no {dtype_name}")
        raw = torch.arange(16, dtype=torch.uint8)
        return raw.view(dtype) if dtype.itemsize == 1 else raw.view(torch.int16).view(dtype)

    return make


def _nested(layout: torch.layout) -> Callable[[], torch.Tensor]:
    parts = [torch.arange(6.0).reshape(2, 3), torch.arange(9.0).reshape(3, 3)]
    return lambda: torch.nested.nested_tensor(parts, layout=layout)


KINDS: dict[str, Callable[[], torch.Tensor]] = {
    "nested jagged": _nested(torch.jagged),
    "nested strided": _nested(torch.strided),
    "nested strided parameter": lambda: torch.nn.Parameter(_nested(torch.strided)()),
    "sparse_coo": lambda: torch.eye(3).to_sparse(),
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "sparse_csc": lambda: torch.eye(3).to_sparse_csc(),
    "sparse_bsr": lambda: torch.eye(4).to_sparse_bsr((2, 2)),
    "mkldnn": lambda: torch.arange(4.0).to_mkldnn(),
    "meta": lambda: torch.ones(3, device="meta"),
    "quantized": lambda: torch.quantize_per_tensor(torch.arange(4.0), 0.5, 1, torch.qint8),
    "tensor subclass": lambda: torch.ones(3).as_subclass(SavedSubclass),
    "local tensor subclass": _local_subclass,
    "uninitialized parameter": lambda: torch.nn.UninitializedParameter(),
    "uninitialized buffer": lambda: torch.nn.UninitializedBuffer(),
    "complex32": lambda: torch.arange(6.0).view(3, 2).to(torch.float16).view(torch.chalf),
    "complex64 conjugated": lambda: torch.arange(4.0).to(torch.cfloat).mul(1j).conj(),
    "negative view": lambda: torch.arange(4.0).to(torch.cfloat).mul(1j).conj().imag,
    "expanded (zero stride)": lambda: torch.arange(2.0).expand(3, 2),
    **{
        name: _of(name)
        for name in (
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "float4_e2m1fn_x2",
            "bits8",
            "bits16",
            "bits1x8",
            "bits2x4",
            "bits4x2",
            "uint16",
            "uint32",
            "uint64",
            "int1",
            "int4",
            "uint1",
            "uint7",
        )
    },
}


def _same(a: torch.Tensor, b: Any) -> bool:
    """``b`` holds exactly ``a``'s values, dtype, shape and layout."""
    if not isinstance(b, torch.Tensor) or (a.dtype, a.layout) != (b.dtype, b.layout):
        return False
    if a.is_nested:
        return len(a.unbind()) == len(b.unbind()) and all(
            torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True)
        )
    if a.layout != torch.strided:
        return torch.equal(a.to_dense(), b.to_dense())
    if a.is_quantized:
        return (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point()) and (
            torch.equal(a.int_repr(), b.int_repr())
        )
    if a.shape != b.shape:
        return False
    # bytes compared: no comparison op exists for most of these dtypes
    return bool(
        a.resolve_conj().resolve_neg().contiguous().view(torch.uint8).equal(b.view(torch.uint8))
    )


def _steps_written(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("step-"))


@pytest.mark.parametrize("allow_torch_save", [False, True], ids=["no-pickle", "torch-save"])
def test_an_exotic_tensor_is_stored_exactly_or_refused_by_key_before_writing(
    tmp_path: Path, allow_torch_save: bool
) -> None:
    outcomes: dict[str, str] = {}
    with CheckpointManager(
        tmp_path, keep_last=None, allow_torch_save=allow_torch_save, compression="none"
    ) as mgr:
        for step, (kind, make) in enumerate(KINDS.items(), start=1):
            leaf = make()
            written = _steps_written(tmp_path)
            try:
                handle = mgr.save(step, {"model": {"leaf": leaf}, "step": step})
            except CociError as e:
                error = str(e)
            else:
                error = None
            if error is not None:
                assert KEY in error, (kind, error)
                assert _steps_written(tmp_path) == written, kind  # refused before writing
                outcomes[kind] = "refused"
                continue
            handle.wait()  # raises if the writer failed: stored, or refused, nothing between
            restored = mgr.restore(step=step)["model"]["leaf"]
            assert _same(leaf, restored), (kind, leaf, restored)
            outcomes[kind] = "stored"
        mgr.save(0, {"model": {"leaf": torch.ones(2)}}).wait()  # the manager saves on
        assert 0 in mgr.steps()
    # what coci stores itself, whatever the option; the rest only with torch.save, or never
    assert {k for k, v in outcomes.items() if v == "stored"} >= {
        "complex32",
        "complex64 conjugated",
        "negative view",
        "expanded (zero stride)",
        "float8_e4m3fn",
        "float8_e5m2",
        "bits8",
        "uint16",
    }
    refused = {"meta", "uninitialized parameter", "uninitialized buffer", "mkldnn", "int1"}
    refused |= {"local tensor subclass"}
    if not allow_torch_save:
        refused |= {k for k in KINDS if k.startswith(("nested", "sparse"))}
        refused |= {"quantized", "tensor subclass"}
    assert {k for k, v in outcomes.items() if v == "refused"} >= refused, outcomes


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_tensor_inside_a_torch_func_transform_is_refused_by_key(
    tmp_path: Path, transform: str
) -> None:
    refused: list[CociError] = []
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:

        def step(x: torch.Tensor) -> torch.Tensor:
            try:
                mgr.save(1, {"model": {"leaf": x}})
            except CociError as e:
                refused.append(e)
            return x.sum()

        if transform == "grad":
            torch.func.grad(step)(torch.ones(3))
        else:
            torch.vmap(step)(torch.ones(2, 3))
        assert len(refused) == 1 and KEY in str(refused[0]), refused
        assert "torch.func transform" in str(refused[0])
        assert _steps_written(tmp_path) == []
