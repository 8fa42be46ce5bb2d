#!/usr/bin/env bash
# Build .gpu_carry/: the pure-Python packages the GPU machine's image lacks, for ITS python.
#
#     bash benchmarks/gpu_carry.sh            # here, with network (PyPI); a few seconds
#     PYVER=3.11 OUT=/tmp/carry311 bash benchmarks/gpu_carry.sh   # the same set for this machine's
#                                             # python, to rehearse the device's torch 2.11 run here
#
# The device machine (one H200) runs python 3.12 with torch 2.11 and no network: nothing can be
# installed there. llmtrain's recipe layer needs pydantic (pydantic_core is compiled: the wheel
# must be cp312 manylinux x86_64, whatever python builds the folder; this machine's is 3.11), so
# the wheels are downloaded for that target with pip's cross-platform flags and UNPACKED into
# .gpu_carry/site (a wheel is a zip of its site-packages entries: unpacking it is installing it
# without pip's scripts, which nothing here uses). On the device, benchmarks/gpu_check.py puts
# .gpu_carry/site first on its own and its worker's path when pydantic is missing and the python
# is the one the folder was built for (.gpu_carry/python-version); by hand:
#     PYTHONPATH=.gpu_carry/site python3 benchmarks/gpu_check.py
# (`run` tool: carry [".gpu_carry"]; docs/benchmarks.md has the exact command).
#
# torchao: the project pins 0.18 (torch 2.13). torchao's Python parts (Float8 training,
# AdamW8bit) run on any torch its own version check accepts; TORCHAO_VERSION below (0.17.0, the
# release before the project's pin) imported, and the 8-bit/bf16 AdamW states step passed, under
# torch 2.11 in a throwaway venv here (0.18 was not tried there; its compiled extensions are
# built for a newer torch, and fail to load even on 2.13 CPU, harmlessly). Float8 on CUDA is
# untested. Set TORCHAO_VERSION= (empty) to leave it out: the fp8 and 8-bit steps then record
# "torchao not available" and run nothing.
# Versions are pinned to what the project's venv runs (pydantic 2.14.4 needs pydantic_core
# 2.50.5 exactly); typing_extensions is carried too because pydantic 2.14 needs a newer one than
# an image may hold.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.gpu_carry}
PYVER=${PYVER:-3.12}
TORCHAO_VERSION=${TORCHAO_VERSION-0.17.0}
PKGS=(pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0)
[ -n "$TORCHAO_VERSION" ] && PKGS+=("torchao==$TORCHAO_VERSION")
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/site"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT/wheels" "${PKGS[@]}"
for w in "$OUT"/wheels/*.whl; do
    python3 -m zipfile -e "$w" "$OUT/site"
done
rm -rf "$OUT/wheels"  # the unpacked tree is what travels: keep the carry small
echo "$PYVER" > "$OUT/python-version"  # benchmarks/gpu_check.py uses the folder only under this python
[ "$OUT" != .gpu_carry ] || grep -qxF '.gpu_carry/' .gitignore || echo '.gpu_carry/' >> .gitignore
du -sh "$OUT" | sed 's/^/carry folder: /'
ls "$OUT/site" | grep -i dist-info
