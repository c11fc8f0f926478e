# sourced first by every call: the wheels the GPU machine lacks (liger-kernel apart, in /tmp/liger, so that a
# command takes it only when it puts /tmp/liger on PYTHONPATH), and a cached extension build if one came along
rm -rf /tmp/site /tmp/liger
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(ls .whl/*.whl | grep -v liger_kernel) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/liger .whl/liger_kernel-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCH_EXTENSIONS_DIR=/tmp/ext
if [ -f .ext/ext.tgz ] && [ ! -d /tmp/ext ]; then tar xzf .ext/ext.tgz -C /tmp; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h /tmp | tail -1
