# Sourced at the top of a GPU script: make DeepSpeed importable on the GPU image, which has torch, CUDA and
# most of DeepSpeed's dependencies but not DeepSpeed, and no package registry. The wheels travel in .whl/
# (filled on the CPU machine by `bash bench/fetch_gpu_wheels.sh`; ignored by git, carried by the device call).
#
#   source bench/gpu_env.sh && python -c "import deepspeed"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH \
    || echo "gpu_env.sh: installing .whl/*.whl failed" >&2
else
  echo "gpu_env.sh: no .whl/ folder: run 'bash bench/fetch_gpu_wheels.sh' on the CPU machine and carry .whl" >&2
fi
# DeepSpeed never JIT-builds an op here: the trainer passes a client AdamW and uses no fused kernels of DeepSpeed's.
export DS_BUILD_OPS=0
python3 -c "import deepspeed, sys; print('deepspeed', deepspeed.__version__, 'from', deepspeed.__file__)" 2>&1 | tail -1
