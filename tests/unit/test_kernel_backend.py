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


def test_triton_language_imported_before_the_interpreter_was_chosen_is_named_not_a_cryptic_failure():
    """transformers imports triton.language; on CPU its jit helpers then stay compiled-mode whatever
    TRITON_INTERPRET says later, and a kernel fails with "Cannot call @triton.jit'd outside of the scope of a
    kernel". The backend says so instead (fresh interpreters: this session's triton is already interpreted)."""
    import os
    import subprocess
    import sys

    probe = ("import triton.language, torch; from triton_kernels import backend; backend.configure_triton(gpu=False); "
             "print(repr(backend.triton_unavailable('cpu')))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    late = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert late.returncode == 0, late.stderr
    assert "triton.language was imported before TRITON_INTERPRET=1" in late.stdout
    early = subprocess.run([sys.executable, "-c", probe], env={**env, "TRITON_INTERPRET": "1"}, capture_output=True,
                           text=True, timeout=120)
    assert early.returncode == 0 and early.stdout.strip() == "''", early.stderr
