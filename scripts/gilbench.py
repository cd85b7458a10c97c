"""The pack's copy with the GIL held or released, beside threads of the same process: why ``client.pack_runs`` holds it.

    python scripts/gilbench.py

A share of ~5.4 MB in 4 fields of 28 runs each (runs of 5-90 KB from two source arrays), packed by two threads at
once into their own buffers, alone and beside one thread running pure Python (a trainer's step, a feed's replies,
in-process producers), by five copies: ``np.copyto`` per run, a ``memoryview`` assignment per run (the GIL held),
``np.concatenate`` per field, ``torch.cat`` per field, ``torch._foreach_copy_`` per share. Prints each one's median
ms per pack and GB/s. A copy that drops the GIL per run (or per torch call) waits out a switch interval (5 ms) to get
it back whenever another thread runs Python.
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")  # torch.from_numpy of read-only views
torch.set_num_threads(1)
rng = np.random.default_rng(0)


def make_share() -> list[list[np.ndarray]]:
    srcs = [np.ones(6_000_000, np.uint8) for _ in range(2)]
    out = []
    for _ in range(4):
        runs = []
        for i in range(28):
            a, n = int(rng.integers(0, 5_000_000)), int(rng.integers(5_000, 90_000))
            runs.append(srcs[i % 2][a:a + n])
        out.append(runs)
    return out


def pack_copyto(share, buf) -> None:  # noqa: ANN001
    off = 0
    for runs in share:
        for r in runs:
            np.copyto(buf[off:off + r.nbytes], r)
            off += r.nbytes


def pack_held(share, buf) -> None:  # noqa: ANN001
    dst, off = memoryview(buf), 0
    for runs in share:
        for r in runs:
            dst[off:off + r.nbytes] = memoryview(r)
            off += r.nbytes


def pack_concat(share, buf) -> None:  # noqa: ANN001
    off = 0
    for runs in share:
        n = sum(r.nbytes for r in runs)
        np.concatenate(runs, out=buf[off:off + n])
        off += n


def pack_cat(share, buf) -> None:  # noqa: ANN001
    whole, off = torch.from_numpy(buf), 0
    for runs in share:
        n = sum(r.nbytes for r in runs)
        torch.cat([torch.from_numpy(r) for r in runs], out=whole[off:off + n])
        off += n


def pack_foreach(share, buf) -> None:  # noqa: ANN001
    whole, off, dst, src = torch.from_numpy(buf), 0, [], []
    for runs in share:
        for r in runs:
            dst.append(whole[off:off + r.nbytes])
            src.append(torch.from_numpy(r))
            off += r.nbytes
    torch._foreach_copy_(dst, src)


def main() -> None:
    shares = [make_share() for _ in range(4)]
    size = max(sum(r.nbytes for runs in s for r in runs) for s in shares)
    bufs = [np.empty(size, np.uint8) for _ in range(4)]
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    for name, fn in [("np.copyto per run", pack_copyto), ("memoryview per run, GIL held", pack_held),
                     ("np.concatenate per field", pack_concat), ("torch.cat per field", pack_cat),
                     ("torch._foreach_copy_", pack_foreach)]:
        for busy_threads in (0, 1):
            stop.clear()
            spin = [threading.Thread(target=busy) for _ in range(busy_threads)]
            for t in spin:
                t.start()
            medians: list[float] = []

            def worker(k: int) -> None:
                ts = []
                for rep in range(30):
                    i = (rep + k) % 4
                    t0 = time.perf_counter()
                    fn(shares[i], bufs[(i + 2 * k) % 4])
                    ts.append(time.perf_counter() - t0)
                medians.append(float(np.median(ts)))

            workers = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            stop.set()
            for t in spin:
                t.join()
            ms = float(np.mean(medians))
            print(f"{name:30s} busy threads {busy_threads}: {ms * 1e3:8.2f} ms per pack, {size / ms / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
