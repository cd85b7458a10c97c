#!/usr/bin/env bash
# GPU check for issue 3 (triton_kernels): on a machine with an NVIDIA GPU, install what is missing, run the
# kernel-vs-reference equality tests compiled on the GPU (TRITON_INTERPRET=0), run the kernels table (its GPU claims:
# fraction of spec HBM bandwidth, hashes/s vs SGLang), and print a short summary. Budget: under 8 minutes on an
# H200 (each stage has its own timeout). python -m repro.kernels decides TRITON_INTERPRET itself (compiled on a GPU).
#   scripts/gpu_check.sh            # on the GPU machine
#   scripts/gpu_check.sh --dry-run  # the same stages on CPU: Triton's interpreter, tiny sizes, no installs
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch, triton" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
export WANDB_MODE=offline WANDB_SILENT=true PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=results/kernels
TESTS=(tests/unit/test_kernel_encoding_hash.py tests/unit/test_kernel_batched_pack.py
       tests/equivalence/test_kernel_hash_equivalence.py tests/equivalence/test_kernel_pack_equivalence.py
       tests/property/test_kernel_hash_props.py tests/property/test_kernel_pack_props.py)

if [[ $DRY == 1 ]]; then
  echo "== dry run: CPU, TRITON_INTERPRET=1, tiny sizes"
  export TRITON_INTERPRET=1
  OUT=results/kernels-dryrun
  ARGS=(device=cpu "images=[1,2]" "pack_tokens=[8192]" sglang_batch=1 passes=2 plan_sequences=64)
else
  command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this script needs an NVIDIA GPU (or --dry-run)"; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  export TRITON_INTERPRET=0
  missing=$($PY - <<'PY'
import importlib.util as u
mods = {"torch": "torch", "triton": "triton", "pytest": "pytest", "hypothesis": "hypothesis", "hydra": "hydra-core",
        "omegaconf": "omegaconf", "matplotlib": "matplotlib", "tqdm": "tqdm", "pytest_benchmark": "pytest-benchmark"}
print(" ".join(p for m, p in mods.items() if u.find_spec(m) is None))
PY
)
  if [[ -n "$missing" ]]; then echo "== installing: $missing"; timeout 180 $PY -m pip install -q $missing; fi
  $PY -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA here'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
  ARGS=(device=cuda "images=[1,16,64,256]" "pack_tokens=[131072,1048576,8388608]" sglang_batch=256 passes=11)
fi

echo "== equality tests (kernel vs reference)"
timeout 240 $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tail -5
mkdir -p "$(dirname "$OUT")"
echo "== kernels table -> $OUT"
timeout 240 $PY -m repro.kernels logger=none out_dir="$OUT" "${ARGS[@]}" > "$OUT.log" 2>&1 || { tail -30 "$OUT.log"; exit 1; }
echo "== summary"
$PY - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
for c in s["claims"]:
    m = c["measured"]
    rng = f" [{c['low']:.3g}, {c['high']:.3g}]" if c.get("low") is not None else ""
    print(f"{c['name']:40s} {c['status']:>12s}  measured={'-' if m is None else format(m, '.4g')}{rng} "
          f"bound={c['bound'] or '-'}  {c['note']}")
for r in s["rows"]:
    if "GB/s" in r:
        print(f"  {r['op']:15s} {r['impl']:9s} {r['size']:34s} {r['outputs'] or '':6s} {r['GB/s']:9.2f} GB/s "
              f"({r['clock']})  memcpy x{r['frac_memcpy']:.2f} [{r['frac_min']:.2f}, {r['frac_max']:.2f}]")
    elif r["op"] == "plan":
        print(f"  plan {r['impl']}: {r['microbatches']} micro-batches, rank imbalance {r['rank_imbalance']:.4f}, "
              f"micro-batch imbalance {r['microbatch_imbalance']:.4f}")
PY
