#!/usr/bin/env bash
# The accelerator check (python -m loopjax.bench accelerator), with what JAX
# needs for the accelerator installed first from this repository's own files:
#   launch/accelerator_check.sh OUT_DIR [--smoke]
# - JAX already sees a GPU or TPU: nothing is installed.
# - ./.whl exists (an offline machine; launch/accelerator_wheels.sh fills it
#   where pip works): its wheels are installed beside the machine's packages.
# - Otherwise: pip install -e '.[cuda13]' (LOOPJAX_EXTRA=cuda12 or tpu to change).
# Every part's result lands in OUT_DIR/accelerator.json as it finishes.
set -euo pipefail
out=${1:?usage: launch/accelerator_check.sh OUT_DIR [--smoke]}
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
  site=${TMPDIR:-/tmp}/loopjax_site
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"  # after the machine's own jax
fi
accelerated() { "$python" -c 'import jax, sys; sys.exit(jax.default_backend() == "cpu")'; }
if [[ " $* " != *" --smoke "* ]] && ! accelerated; then
  "$python" -m pip install -q -e ".[${LOOPJAX_EXTRA:-cuda13}]"
  accelerated || { echo "error: JAX sees no accelerator after installing .[${LOOPJAX_EXTRA:-cuda13}]"; exit 2; }
fi
"$python" -c 'import jax; print("jax", jax.__version__, jax.devices())'
exec "$python" -m loopjax.bench accelerator --out="$out" "$@"
