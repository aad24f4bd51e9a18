# Image of the MTP serving daemon with the bundled demo model.
# Build: docker build -t mtp-serve .                                  (CPU torch, the default)
#        docker build --build-arg TORCH_BUILD=cuda -t mtp-serve:cuda .  (CUDA torch; run with --gpus all)
# Run:   docker run --rm -p 1025:1025 -p 1026:1026 -p 1027:1027 mtp-serve
# The image serves conf/container.json: conf/config.json bound to 0.0.0.0 (with
# allowAllZeroIpListening: true), so the published business (1025), management (1026) and
# metrics (1027) ports answer from the host.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /opt/mtp-serve

# Torch first, so the project's "torch>=2.4" is already satisfied.  cpu: PyTorch's CPU
# wheel index (no nvidia-* packages); cuda: the default index's build, or TORCH_CUDA_INDEX
# (e.g. https://download.pytorch.org/whl/cu128) when set.
ARG TORCH_BUILD=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=""
RUN case "$TORCH_BUILD" in \
      cpu)  pip install --no-cache-dir --index-url "$TORCH_CPU_INDEX" torch==2.13.0 ;; \
      cuda) pip install --no-cache-dir ${TORCH_CUDA_INDEX:+--index-url "$TORCH_CUDA_INDEX"} torch==2.13.0 ;; \
      *)    echo "TORCH_BUILD=$TORCH_BUILD; allowed: cpu, cuda" >&2; exit 2 ;; \
    esac
COPY pyproject.toml README.md ./
COPY server ./server
RUN pip install --no-cache-dir .
COPY conf ./conf
COPY models ./models
COPY scripts ./scripts

EXPOSE 1025 1026 1027
ENTRYPOINT ["python", "-m", "server"]
# Another config: mount it and pass --config-file; binding 0.0.0.0 needs
# allowAllZeroIpListening: true in it (MIES_CONTAINER_IP / MIES_CONTAINER_MANAGEMENT_IP
# override the bind addresses).
CMD ["--config-file", "conf/container.json"]
