"""The example lengths file the README's planner command reads (``workloads/examples/lengths.csv``).

It is synthetic, not measured: 256 prompts x 8 samples drawn from ``knittrans.sim.lengths.LengthDist`` (median
1200 tokens, sigma 1.1, half of the log-variance shared within a prompt, truncated at 8192), written as a CSV with
a ``prompt_id`` column (the group) and a ``num_tokens`` column, the shape of a table a user exports from their own
rollout logs (or of ``knittrans.Handoff.records()``: ``group_id``, ``num_tokens``). ``tests/unit/test_plan_io.py``
checks the committed file is what ``rows()`` draws.

    python -m workloads.example_lengths      # rewrite workloads/examples/lengths.csv
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from knittrans.sim.lengths import LengthDist

PATH = Path(__file__).parent / "examples" / "lengths.csv"
DIST = LengthDist(median=1200.0, sigma=1.1, max_len=8192)
PROMPTS, SAMPLES, SEED = 256, 8, 2027


def rows() -> list[tuple[int, int]]:
    """(prompt id, response length) of every response, prompt by prompt."""
    lens = DIST.sample(np.random.default_rng(SEED), PROMPTS, SAMPLES)
    return [(p, int(v)) for p in range(PROMPTS) for v in lens[p]]


def write(path: Path = PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt_id", "num_tokens"])
        w.writerows(rows())
    return path


if __name__ == "__main__":
    print(write())
