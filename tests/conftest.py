"""Test-wide environment: offline everything, and Triton's interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any @triton.jit definition executes, so it is set here, before test modules
import the kernels. Set TRITON_INTERPRET=0 explicitly to compile the kernels on a GPU machine.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        _has_cuda = False
    os.environ["TRITON_INTERPRET"] = "0" if _has_cuda else "1"

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True,
                          print_blob=True)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
