# syntax=docker/dockerfile:1
# orchestrator: the public splittts.tts.v1 API. Build from the repository root:
#   docker build -f docker/orchestrator.Dockerfile -t split-tts/orchestrator:0.3.0 .
ARG BASE_IMAGE=python:3.11.14-slim-bookworm

FROM ${BASE_IMAGE} AS builder
# torch is a dependency of the one split-tts distribution; the orchestrator never runs it, so the
# CPU wheel keeps the image small.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH}
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
    && pip install --no-cache-dir grpcio-tools==1.85.1 protobuf==7.36.2
WORKDIR /src
COPY . .
# Generated gRPC code is never committed: compile it here so the wheel carries splittts/.
# pypinyin: the Mandarin front end's G2P (text to tone-numbered pinyin).
RUN python protos/generate.py . \
    && pip install --no-cache-dir /src pypinyin==0.55.0 aiohttp==3.14.5 cryptography==50.0.2 \
        grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
        numpy==2.4.6 safetensors==0.8.0 transformers==5.24.0 tokenizers==0.23.3 \
        prometheus-client==0.26.0 soundfile==0.14.0 soxr==1.1.0 onnx==1.23.2 \
        onnxruntime==1.32.0 \
    && mkdir -p /src/voices

FROM ${BASE_IMAGE}
# The text front end's G2P calls libespeak-ng in process (ctypes, the phoneme trace of
# `espeak-ng -q -x`); the espeak-ng package brings that library and its voice data.
ARG ESPEAK_NG_VERSION=1.51+dfsg-10+deb12u2
RUN apt-get update \
    && apt-get install -y --no-install-recommends "espeak-ng=${ESPEAK_NG_VERSION}" \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 splittts \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/splittts splittts
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /src/voices /opt/split-tts/voices
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
USER 10001:10001
WORKDIR /home/splittts
EXPOSE 50050 9090 8080 50060
# grpc.health.v1 Check on this service's plaintext health-only port (--health-port), which
# answers whether or not the gRPC port runs TLS; exit 0 only when it says SERVING.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys,grpc;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;r=g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(h.HealthCheckRequest(service=sys.argv[2]),timeout=4);sys.exit(r.status!=h.HealthCheckResponse.SERVING)", "127.0.0.1:50060", "splittts.tts.v1.TextToSpeech"]
CMD ["orchestrator", "--host", "0.0.0.0", "--port", "50050", "--metrics-port", "9090", "--http-port", "8080", \
     "--health-port", "50060", "--text-service", "text-service:50051", \
     "--vocoder-service", "vocoder-service:50052", "--voice", "/opt/split-tts/voices/default"]
