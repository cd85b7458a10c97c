"""Triton's mode is decided once per process, before any kernel is defined; a mode that cannot run says why."""

from __future__ import annotations

import pytest
import torch

from triton_kernels import backend


def test_configure_sets_the_interpreter_without_a_gpu_and_compiles_with_one(monkeypatch):
    monkeypatch.setattr(backend, "_defined_interpreted", lambda: {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "interpreter" in backend.configure_triton(gpu=False)
    assert backend.triton_unavailable("cpu") == ""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    line = backend.configure_triton(gpu=True)
    assert "compiled" in line and "overriding TRITON_INTERPRET=1" in line
    import os

    assert os.environ["TRITON_INTERPRET"] == "0"


def test_kernels_already_defined_in_the_other_mode_cannot_be_switched(monkeypatch):
    monkeypatch.setattr(backend, "_defined_interpreted", lambda: {"triton_kernels.batched_pack.kernel": True})
    with pytest.raises(RuntimeError, match="already imported"):
        backend.configure_triton(gpu=True)
    monkeypatch.setattr(backend, "_defined_interpreted", lambda: {"triton_kernels.batched_pack.kernel": False})
    assert "imported compiled" in backend.triton_unavailable("cpu")


def test_the_kernels_this_test_session_imported_match_what_the_backend_reports():
    import triton_kernels.encoding_hash.kernel  # noqa: F401  (conftest set TRITON_INTERPRET first)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert backend.triton_unavailable(device) == ""
    assert backend._defined_interpreted()["triton_kernels.encoding_hash.kernel"] == (device == "cpu")
