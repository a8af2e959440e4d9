# Sourced by the GPU scripts: puts NVRTC (libnvrtc.so.13) and NCCL (as libnccl.so, the name the
# loader asks for) on LD_LIBRARY_PATH, from the toolkit or the wheels beside PyTorch, and keeps
# NVLink multicast off. Sets NV (the wheels' nvidia folder) and NCCL_LIB.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# (head closes the pipe early: '|| true' keeps callers running with pipefail on.)
NV=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 "$NV/cu13/lib"; do
  if [ -n "$d" ] && ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; fi
done
NCCL_LIB=$( (ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF}'; \
             ls /usr/lib/x86_64-linux-gnu/libnccl.so.2 /usr/local/cuda/lib64/libnccl.so.2 2>/dev/null; \
             [ -n "$NV" ] && find "$NV" -name 'libnccl.so.2' 2>/dev/null) | head -1 || true)
NCCL_LINK_DIR=$(mktemp -d)
if [ -n "$NCCL_LIB" ]; then ln -sf "$NCCL_LIB" "$NCCL_LINK_DIR/libnccl.so"; fi
export LD_LIBRARY_PATH="$NCCL_LINK_DIR:${LD_LIBRARY_PATH:-}"
