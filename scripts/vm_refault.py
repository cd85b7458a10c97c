"""How much a VM's free page reporting costs an allocation: fill 256 MB afresh after the last 256 MB was freed
0 to 2 s earlier, with the guest's ``page_reporting`` as it is and held off (``repro.pagereport``).

    python scripts/vm_refault.py 6        # needs root to hold it off; prints each gap's fill times, ms

On a KVM guest that reports free pages at once (``min_free_ms`` 0), memory freed long enough ago to have been
reported faults in at the host again when it is reused, and the fill takes several times as long; held off, every
gap costs the same. Without the parameter (bare metal) both halves are the same machine.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from repro.pagereport import page_reporting_held

GAPS = (0.0, 0.1, 0.5, 2.0)


def fills(rounds: int) -> dict[float, list[float]]:
    out: dict[float, list[float]] = {g: [] for g in GAPS}
    for _ in range(rounds):
        for gap in GAPS:
            a = np.ones(256 << 20, np.uint8)
            del a
            time.sleep(gap)
            t = time.perf_counter()
            b = np.ones(256 << 20, np.uint8)
            out[gap].append((time.perf_counter() - t) * 1e3)
            del b
    return out


def main(rounds: int) -> None:
    for label, held in (("as it is", False), ("held off", True)):
        if held:
            with page_reporting_held() as line:
                got = fills(rounds)
        else:
            got, line = fills(rounds), "free page reporting as the machine has it"
        print(f"{label}: {line}")
        for gap, ms in got.items():
            print(f"  freed {gap:4.1f} s before: fill 256 MB {sorted(round(x) for x in ms)} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
