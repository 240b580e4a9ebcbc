#!/usr/bin/env bash
# On the CPU machine (it reaches PyPI): fill .whl/ with DeepSpeed 0.19.8 as a pure wheel and the dependencies
# the GPU image lacks, for its Python 3.12 (about 5 MB). bench/gpu_env.sh installs them there.
#
#   bash bench/fetch_gpu_wheels.sh        # then carry .whl in the device call
#
# The GPU image already has einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, tqdm, sentencepiece
# and tensorboard (/work/.library/device/KINDS.md); the versions below are the ones the CPU venv runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
mkdir -p .whl
DS_BUILD_OPS=0 $PIP wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing_extensions==4.16.0
ls -la .whl
