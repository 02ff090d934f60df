# Source on the GPU host after installing MLX under /tmp/site (docs/offline-gpu-install.md):
# mlx-cuda-13's libmlx.so finds the CUDA libraries through RPATH $ORIGIN/../../nvidia/...: point
# /tmp/site/nvidia at the machine's own nvidia-* wheels (PyTorch's), and add them to the loader path.
# Those wheels' headers lack crt/, which MLX's JIT of some kernels includes (float32 4-bit
# matmuls: "cannot open source file crt/mma.h"); where the host's CUDA toolkit has it,
# /tmp/site/nvidia is a tree of links to the wheels with crt/ from the toolkit.
if [ ! -e /tmp/site/nvidia ]; then
  nv=${NVIDIA_WHEELS:-$(python3 -c "import nvidia; print([p for p in nvidia.__path__ if not p.startswith('/tmp/site')][0])" 2>/dev/null)}
  crt=$(ls -d ${CUDA_INCLUDE_GLOB:-/usr/local/cuda*/include}/crt 2>/dev/null | head -1)
  if [ -n "$nv" ] && [ -d "$nv/cu13/include" ] && [ ! -e "$nv/cu13/include/crt" ] && [ -n "$crt" ]; then
    mkdir -p /tmp/site/nvidia/cu13/include
    for p in "$nv"/*; do [ "${p##*/}" = cu13 ] || ln -s "$p" /tmp/site/nvidia/; done
    for p in "$nv"/cu13/*; do [ "${p##*/}" = include ] || ln -s "$p" /tmp/site/nvidia/cu13/; done
    for p in "$nv"/cu13/include/*; do ln -s "$p" /tmp/site/nvidia/cu13/include/; done
    ln -s "$crt" /tmp/site/nvidia/cu13/include/crt
  elif [ -n "$nv" ]; then
    ln -s "$nv" /tmp/site/nvidia
  fi
fi
export LD_LIBRARY_PATH=$(ls -d /tmp/site/nvidia/*/lib 2>/dev/null | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
