#!/usr/bin/env bash
# Download, on a machine with a package registry, the wheels that the GPU machine's image lacks
# for the trainer (Python 3.12, x86_64; that image has torch, numpy, tensorboard, opencv,
# cloudpickle but not these), into <repo>/.whl/ (git-ignored). benchmark/gpu_check.sh installs
# them there; a device call names `.whl` in its carry list.
#   bash benchmark/fetch_gpu_wheels.sh [DEST]      # default DEST: <repo>/.whl
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$REPO/.whl}
PY=${PYTHON:-python3}
# gymnasium, ale-py, tyro as requirements*.txt pin them; then what they need that the image lacks:
# farama-notifications (gymnasium), docstring-parser and typeguard (tyro), typing-extensions
# (typeguard needs >= 4.14; the image's version is unknown, this one is the project's)
WHEELS=(
    gymnasium==1.4.0
    ale-py==0.12.1
    tyro==1.0.17
    farama-notifications==0.0.6
    docstring-parser==0.18.0
    typeguard==4.6.1
    typing-extensions==4.16.0
)
mkdir -p "$DEST"
# one version of each: two would stop the install there
rm -f "$DEST"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
echo "total: $(du -ch "$DEST"/*.whl | tail -1 | cut -f1) in $(ls "$DEST"/*.whl | wc -l) wheels"
