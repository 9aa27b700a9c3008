#!/usr/bin/env bash
# run.sh MOESTASH — CTest's hf_oracle: pytest on tests/hf with the PyTorch
# venv's python ($MST_TORCH_VENV, default ~/.cache/moestash/venv-torch) and
# the moestash program MOESTASH. Exit 77 (skipped) where the venv lacks
# torch, transformers, safetensors or pytest (scripts/test.sh installs them);
# pytest's exit 5 (no test collected) counts as a pass.
set -uo pipefail
[ $# = 1 ] || { echo "usage: run.sh MOESTASH" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
py=${MST_TORCH_VENV:-$HOME/.cache/moestash/venv-torch}/bin/python
if ! "$py" -c 'import torch, transformers, safetensors, pytest' 2>/dev/null; then
  echo "hf_oracle: no torch + transformers + safetensors + pytest in ${py%/bin/python} (scripts/test.sh installs them): skipped"
  exit 77
fi
# strict: a flag or command the tests need that the program lacks fails the
# test (MST_HF_STRICT=0: skips it, for a tree where a feature is missing)
export MST_HF_STRICT=${MST_HF_STRICT:-1}
export MST_MOESTASH=$1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1
tmp=$(mktemp -d /tmp/mst-hf.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pytest -q -rs -p no:cacheprovider --basetemp "$tmp" "$here"
rc=$?
[ $rc = 5 ] && rc=0
exit $rc
