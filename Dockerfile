# Image of the MTP serving daemon with the bundled demo model.
# Build: docker build -t mtp-serve .                                  (CPU torch, the default)
#        docker build --build-arg TORCH_BUILD=cuda -t mtp-serve:cuda .  (CUDA torch; run with --gpus all)
#        docker build --build-arg OFFLINE=1 -t mtp-serve .              (every wheel from wheels/, no index)
# Run:   docker run --rm -p 1025:1025 -p 1026:1026 -p 1027:1027 mtp-serve
# Check: scripts/container_check.sh (builds, starts, asks one chat completion, reads /v1/status)
# The image serves conf/container.json: conf/config.json bound to 0.0.0.0 (with
# allowAllZeroIpListening: true), so the published business (1025), management (1026) and
# metrics (1027) ports answer from the host.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /opt/mtp-serve

# A C and C++ compiler: the fast paths are built on the machine that serves, at first use.
# server/model/half_avx2.c (our AVX2 kernel: 16-bit and int8 products) is built with cc,
# and the compiled decode step's C++ by Inductor with g++; without them the daemon serves on
# oneDNN and the uncompiled step, the slowest paths (README: Docker).
ARG APT_MIRROR=""
RUN if [ -n "$APT_MIRROR" ]; then \
        sed -i "s|http://deb.debian.org/debian|$APT_MIRROR|g" /etc/apt/sources.list.d/debian.sources; \
    fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Torch first, so the project's "torch>=2.4" is already satisfied.  cpu: PyTorch's CPU
# wheel index (no nvidia-* packages), TORCH_CPU_INDEX; cuda: the default index's build, or
# TORCH_CUDA_INDEX (e.g. https://download.pytorch.org/whl/cu128) when set.  pip looks in
# wheels/ first; OFFLINE=1 installs from wheels/ alone (wheels/README.md says how to fill it).
ARG TORCH_BUILD=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=""
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG OFFLINE=0
ENV PIP_FIND_LINKS=/opt/wheels PIP_NO_CACHE_DIR=1 PIP_INDEX_URL=$PIP_INDEX_URL
COPY wheels/ /opt/wheels/
RUN if [ "$OFFLINE" = 1 ]; then \
        pip install --no-index torch==2.13.0; \
    else case "$TORCH_BUILD" in \
      cpu)  pip install --index-url "$TORCH_CPU_INDEX" torch==2.13.0 ;; \
      cuda) pip install ${TORCH_CUDA_INDEX:+--index-url "$TORCH_CUDA_INDEX"} torch==2.13.0 ;; \
      *)    echo "TORCH_BUILD=$TORCH_BUILD; allowed: cpu, cuda" >&2; exit 2 ;; \
    esac; fi
COPY pyproject.toml README.md ./
COPY server ./server
RUN pip install $([ "$OFFLINE" = 1 ] && echo --no-index) . && command -v cc && command -v g++
COPY conf ./conf
COPY models ./models
COPY scripts ./scripts

EXPOSE 1025 1026 1027
ENTRYPOINT ["python", "-m", "server"]
# Another config: mount it and pass --config-file; binding 0.0.0.0 needs
# allowAllZeroIpListening: true in it (MIES_CONTAINER_IP / MIES_CONTAINER_MANAGEMENT_IP
# override the bind addresses).
CMD ["--config-file", "conf/container.json"]
