# CPU image of the MTP serving daemon with the bundled demo model.
# Build: docker build -t mtp-serve .   Run: docker run -p 1025:1025 mtp-serve
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    MIES_CONTAINER_IP=0.0.0.0 MIES_CONTAINER_MANAGEMENT_IP=0.0.0.0
WORKDIR /opt/mtp-serve

# Torch first, so the project's "torch>=2.4" is already satisfied.  For a CPU-only image
# point pip at a CPU wheel index: --build-arg TORCH_PIP_ARGS="--index-url <cpu wheel index>".
ARG TORCH_PIP_ARGS=""
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_PIP_ARGS}
COPY pyproject.toml README.md ./
COPY server ./server
RUN pip install --no-cache-dir .
COPY conf ./conf
COPY models ./models
COPY scripts ./scripts

EXPOSE 1025 1026 1027
# Binding 0.0.0.0 inside a container needs allowAllZeroIpListening: true in the mounted config.
ENTRYPOINT ["python", "-m", "server"]
CMD ["--config-file", "conf/config.json"]
