"""How the Triton kernels run in this process: compiled for a GPU, or by Triton's interpreter on CPU.

Why
---
Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is *defined* (when a ``kernel.py`` is imported),
not when it runs. The kernel modules are imported lazily, on the first call of a Triton path, so a program decides
once, before that, by calling ``configure_triton``: on a machine with a GPU the kernels compile for it (timings of
interpreted kernels on a GPU would mean nothing); without one the interpreter runs them, slowly, on CPU tensors,
which is enough to check them against the torch references bit for bit. ``python -m repro.kernels`` does this
itself, so it runs outside ``make`` as the README shows it.

``triton_unavailable(device)`` says why the kernels cannot run on a device here ("" when they can): triton not
installed, no GPU for a CUDA device, or a kernel module already defined in the other mode (the environment was
changed too late). A check or gate that needs the kernels asks it first and reports the reason instead of
passing.

Example::

    >>> why = triton_unavailable("cpu")  # "" under TRITON_INTERPRET=1, else the reason
    >>> isinstance(why, str)
    True
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

KERNEL_MODULES = ("triton_kernels.encoding_hash.kernel", "triton_kernels.batched_pack.kernel")
"""Modules that define ``@triton.jit`` kernels (imported lazily by the dispatchers)."""
_KERNEL_OBJECTS = {"triton_kernels.encoding_hash.kernel": "_block_kernel",
                   "triton_kernels.batched_pack.kernel": "_pack_kernel"}


def _defined_interpreted() -> dict[str, bool]:
    """Kernel modules already imported -> whether their kernels were defined for the interpreter."""
    out = {}
    for name, attr in _KERNEL_OBJECTS.items():
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = type(getattr(mod, attr)).__name__ == "InterpretedFunction"
    return out


def _language_interpreted() -> bool | None:
    """Whether ``triton.language`` defined its own ``@triton.jit`` helpers (``cdiv`` and the rest, which every
    kernel calls) for the interpreter; None if it is not imported yet. It takes the mode ``TRITON_INTERPRET`` has
    when it is first imported, and transformers and torch's compiler import it: a CPU process that imported them
    before choosing cannot interpret a kernel ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    std = sys.modules.get("triton.language.standard")
    fn = getattr(std, "cdiv", None) if std is not None else None
    return None if fn is None else type(fn).__name__ == "InterpretedFunction"


def configure_triton(gpu: bool) -> str:
    """Set ``TRITON_INTERPRET`` for this process before any kernel is defined: "0" (compile) when ``gpu``, "1"
    (interpret) otherwise. Returns one line saying what was decided (and what it overrode). Raises RuntimeError if
    a kernel module was already imported in the other mode: it cannot be redefined in this process."""
    want = "0" if gpu else "1"
    before = os.environ.get("TRITON_INTERPRET")
    defined = _defined_interpreted()
    wrong = [m for m, interpreted in defined.items() if interpreted != (want == "1")]
    if wrong:
        raise RuntimeError(f"{', '.join(wrong)} already imported with TRITON_INTERPRET={before!r}; a "
                           f"{'GPU' if gpu else 'CPU'} run needs TRITON_INTERPRET={want} before the first kernel "
                           "import (call configure_triton first)")
    os.environ["TRITON_INTERPRET"] = want
    how = "compiled for the GPU" if gpu else "Triton's interpreter on CPU (no GPU)"
    changed = "" if before in (None, want) else f" (overriding TRITON_INTERPRET={before})"
    return f"Triton kernels: {how}, TRITON_INTERPRET={want}{changed}"


def triton_unavailable(device: torch.device | str) -> str:
    """Why the Triton kernels cannot run on ``device`` in this process; "" when they can."""
    device = torch.device(device)
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        interpreted = [m for m, i in _defined_interpreted().items() if i]
        if interpreted or (not _defined_interpreted() and os.environ.get("TRITON_INTERPRET") == "1"):
            return "TRITON_INTERPRET=1 on a GPU: the kernels would be interpreted (call configure_triton(gpu=True))"
        return ""
    if device.type != "cpu":
        return f"Triton does not run on {device.type}"
    compiled = [m for m, i in _defined_interpreted().items() if not i]
    if compiled:
        return (f"{', '.join(compiled)} was imported compiled (TRITON_INTERPRET was not 1 at the time): the "
                "interpreter cannot run it on CPU in this process")
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "no GPU and TRITON_INTERPRET is not 1 (call configure_triton(gpu=False) before the first kernel)"
    if _language_interpreted() is False:
        return ("triton.language was imported before TRITON_INTERPRET=1 was set (transformers and torch's compiler "
                "import it), so its own jit helpers are compiled-mode and the interpreter cannot run a kernel in this "
                "process: set TRITON_INTERPRET=1 in the environment, or call configure_triton(gpu=False) before "
                "importing them")
    return ""
