"""Run repro tables in order, each in its own process, all forked from one that imported the heavy libraries once.

    python -m repro.runner staleness admission transfer:workload=text     # what `make repro` runs (its TABLES)
    python -m repro.runner --times results/repro-times.tsv quality:seeds=[0,1],logger=none

A table is ``module[:override,override...]``: ``repro.<module>`` (or a dotted module of your own) with those
Hydra overrides, exactly as ``python -m repro.<module> override ...`` runs it. Each table runs in a child process
of its own (``os.fork``; the table's module runs as ``__main__``, its ``atexit`` handlers run when it ends, and
nothing it sets up -- torch threads, Ray, W&B, environment variables -- reaches the next table). What the
children share is the parent's imports: torch, transformers with the two model classes the tables build, numpy,
Hydra, OmegaConf, matplotlib and tqdm. Imported once here, they cost ~9 s once instead of 3-9 s in each of the
12 tables. The parent starts nothing (no Ray, no W&B, no CUDA context, no torch work) and imports no ``knittrans``
module; it sets ``TRITON_INTERPRET`` as every entry point would on this machine, before transformers imports
Triton (``preload``). Tables' timings are taken inside the tables and never include imports, so they are the same
as when a table runs alone.

While the tables run, a VM's free page reporting is held off (``repro.pagereport``: memory a pass frees and the next
reallocates is otherwise handed back to the host in between and refaults there, 4-10x slower); every table's results
record the value they ran with.

``--times FILE``: append ``table<TAB>seconds`` per table as it ends (wall-clock from fork to exit), then
``startup<TAB>seconds`` (the shared imports) and ``total<TAB>seconds`` (the whole run, start-up included); the
file is started afresh with a header. The first table that fails stops the run with its exit status (the rows so
far stay in the file, with no total: ``repro.report`` then says the run did not finish).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

from repro.pagereport import page_reporting_held

PRELOAD = ("numpy", "torch", "transformers", "hydra", "omegaconf", "matplotlib", "tqdm")


def parse(table: str) -> tuple[str, list[str]]:
    """``"mod:a=1,b=2"`` -> ``("repro.mod", ["a=1", "b=2"])``. A dotted name is a module of its own (your table:
    ``mypkg.mytable:x=1``); a bare one is ``repro.<name>``. Overrides split on commas outside brackets, so
    ``quality:seeds=[0,1],logger=none`` keeps its list."""
    mod, _, rest = table.partition(":")
    if not mod or not all(part.isidentifier() for part in mod.split(".")):
        raise ValueError(f"not a table: {table!r} (module[:override,override...], e.g. transfer:workload=text)")
    mod = mod if "." in mod else f"repro.{mod}"
    args, depth, cur = [], 0, ""
    for ch in rest:
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            args.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        args.append(cur)
    return mod, args


def preload() -> str:
    """Import the libraries every table needs, without starting anything (no Ray, no W&B, no torch work, no CUDA
    context). Triton is decided first: transformers imports it, and ``triton.language`` defines its own
    ``@triton.jit`` helpers in the mode ``TRITON_INTERPRET`` says at that moment, so the parent makes the choice every
    entry point makes (``triton_kernels.backend.configure_triton``: compiled with a GPU, interpreted without one)
    before that import, unless the environment already says. Returns that decision's line."""
    import torch

    how = f"Triton: TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} from the environment" \
        if "TRITON_INTERPRET" in os.environ else None
    if how is None:
        from triton_kernels.backend import configure_triton

        how = configure_triton(gpu=torch.cuda.device_count() > 0)  # NVML's count: no CUDA context before a fork
    import matplotlib

    matplotlib.use("Agg")
    for name in PRELOAD:
        __import__(name)
    import matplotlib.pyplot  # noqa: F401
    from transformers import LlamaForCausalLM, Qwen2VLForConditionalGeneration  # noqa: F401  (lazy otherwise)

    return how


def _child(mod: str, args: list[str]) -> int:
    """Run module ``mod`` as ``__main__`` with ``args``, as ``python -m`` would; return its exit status."""
    code = 0
    try:
        sys.argv = [f"-m {mod}", *args]  # runpy sets argv[0] to the module's file
        runpy.run_module(mod, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # Hydra exits 1 on an error it has reported; sys.exit() / sys.exit(0) is success
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a table's crash is its exit status, with its traceback shown
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what interpreter exit would run: Ray's shutdown, W&B's teardown, ...
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    return code


def run_table(table: str) -> int:
    """Fork, run ``table`` in the child, wait; the child's exit status (a signal: 128 + its number)."""
    mod, args = parse(table)
    print(f"== {mod} {' '.join(args)}".rstrip(), flush=True)
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's loop
        code = 1
        try:
            code = _child(mod, args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
    except KeyboardInterrupt:  # Ctrl-C reached both; let the table stop, then stop the run
        os.kill(pid, signal.SIGINT)
        os.waitpid(pid, 0)
        raise
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m repro.runner", description=__doc__.split("\n\n")[0])
    ap.add_argument("tables", nargs="+", help="module[:override,override...]")
    ap.add_argument("--times", type=Path, help="write table<TAB>seconds rows here (startup and total at the end)")
    a = ap.parse_args(argv)
    for t in a.tables:  # every name checked before anything runs: a typo fails now, not after 20 minutes
        try:
            mod, _ = parse(t)
            found = importlib.util.find_spec(mod) is not None
        except (ValueError, ImportError) as e:  # a bad name, or a missing parent package of a dotted one
            ap.error(str(e))
        if not found:
            ap.error(f"no table module {mod} (from {t!r})")
    start = time.time()

    def log(name: str, seconds: float) -> None:
        if a.times is not None:
            with a.times.open("a") as f:
                f.write(f"{name}\t{round(seconds)}\n")

    if a.times is not None:
        a.times.parent.mkdir(parents=True, exist_ok=True)
        a.times.write_text("table\tseconds\n")
    how = preload()
    startup = time.time() - start
    print(f"repro.runner: {how}; shared imports loaded in {startup:.1f} s", flush=True)
    with page_reporting_held() as held:  # every table's results record the value they ran with (run_metadata)
        print(f"repro.runner: {held}", flush=True)
        for t in a.tables:
            t0 = time.time()
            rc = run_table(t)
            if rc != 0:
                print(f"repro.runner: {t} failed (exit status {rc}); stopping", file=sys.stderr)
                return rc
            log(t, time.time() - t0)
    log("startup", startup)
    log("total", time.time() - start)
    if a.times is not None:
        print(a.times.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
