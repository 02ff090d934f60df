# Source on the GPU host after installing MLX under /tmp/site (docs/offline-gpu-install.md):
# mlx-cuda-13's libmlx.so finds the CUDA libraries through RPATH $ORIGIN/../../nvidia/...: point
# /tmp/site/nvidia at the machine's own nvidia-* wheels (PyTorch's), and add them to the loader path.
if [ ! -e /tmp/site/nvidia ]; then
  nv=$(python3 -c "import nvidia; print([p for p in nvidia.__path__ if not p.startswith('/tmp/site')][0])" 2>/dev/null)
  [ -n "$nv" ] && ln -s "$nv" /tmp/site/nvidia
fi
export LD_LIBRARY_PATH=$(ls -d /tmp/site/nvidia/*/lib 2>/dev/null | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
