#!/usr/bin/env bash
# Fill ./.whl with the wheels that launch/accelerator_check.sh installs on an
# offline accelerator machine: loopjax's requirements that a CUDA image with
# JAX, flax, optax and orbax lacks (Python 3.12, x86-64 Linux). Run where pip
# reaches PyPI; ~11 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  array_record==0.8.6 dm-tree==0.1.10 docstring_parser==0.18.0 \
  googleapis-common-protos==1.76.0 grain==0.2.18 immutabledict==4.3.1 \
  importlib_resources==7.1.0 ml_collections==1.1.0 portpicker==1.6.0 simple-parsing==0.1.9 \
  tensorboardX==2.6.5 tensorflow-datasets==4.9.10 tensorflow-metadata==1.21.0 \
  termcolor==3.3.0 toml==0.10.2
"$python" -m pip wheel -q --no-deps -w .whl promise==2.3  # an sdist only
ls .whl
