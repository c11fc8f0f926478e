# sourced first by every call of this folder: the shared wheels (installed once a machine, kept in /tmp while it
# stays warm) and the op builds: unpacked from a carried .ext/ext.tgz, or with BUILD_OPS=1 built here (DeepSpeed's
# CPU Adam and fitone's ops) and packed into $OUT/ext.tgz for the next calls to carry. liger-kernel goes apart into
# /tmp/liger: a command takes it only with /tmp/liger on PYTHONPATH (the GPU lane's loss test does).
if [ ! -f /tmp/site/.fitone-wheels ]; then
  rm -rf /tmp/site /tmp/liger
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(ls .whl/*.whl | grep -v liger_kernel) || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/liger .whl/liger_kernel-*.whl || exit 1
  touch /tmp/site/.fitone-wheels
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCH_EXTENSIONS_DIR=/tmp/ext
if [ -n "${BUILD_OPS:-}" ]; then
  python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" > /tmp/build-cpu-adam.log 2>&1 &
  python3 -c "from fitone.zero2 import adam32; print(adam32.available())" > /tmp/build-adam32.log 2>&1 &
  python3 -c "from fitone.zero2.low_precision import fused_op; fused_op()" > /tmp/build-adam16.log 2>&1 &
  python3 -c "from fitone.zero2 import cpu_adam; cpu_adam.load_op()" > /tmp/build-ds-adam.log 2>&1 &
  python3 -c "import torch; from fitone.zero2 import gpu_adam; gpu_adam._op()" > /tmp/build-adam-gpu.log 2>&1 &
  wait; tail -n 2 /tmp/build-*.log; tar czf $OUT/ext.tgz -C /tmp ext
elif [ -f .ext/ext.tgz ] && [ ! -d /tmp/ext ]; then
  tar xzf .ext/ext.tgz -C /tmp
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h /tmp | tail -1
