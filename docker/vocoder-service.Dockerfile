# syntax=docker/dockerfile:1
# vocoder-service: HiFi-GAN through ONNX Runtime's CUDA execution provider, in fp16. Build from
# the repository root:
#   docker build -f docker/vocoder-service.Dockerfile -t split-tts/vocoder-service:0.3.0 .
# onnxruntime-gpu 1.31 on PyPI is built for CUDA 13 and cuDNN 9: BASE_IMAGE must provide both.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS builder
# The ONNX backend does the GPU work; torch only loads checkpoints and traces the ONNX export, so
# its CPU wheel is enough (set a CUDA wheel index here to use `--backend torch --device cuda`).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG ORT_GPU_VERSION=1.31.1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH}
# Ubuntu's own Python 3.12: its version follows the pinned base image tag and security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
    && pip install --no-cache-dir grpcio-tools==1.85.1 protobuf==7.36.2
WORKDIR /src
COPY . .
# Generated gRPC code is never committed: compile it here so the wheel carries splittts/.
# onnxruntime (a core dependency) and onnxruntime-gpu install the same `onnxruntime` package;
# whichever lands last wins file by file, so remove both and put the GPU build back alone.
RUN python protos/generate.py . \
    && pip install --no-cache-dir "/src[gpu]" "onnxruntime-gpu==${ORT_GPU_VERSION}" \
        grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
        numpy==2.4.6 safetensors==0.8.0 transformers==5.24.0 tokenizers==0.23.3 \
        prometheus-client==0.26.0 soundfile==0.14.0 soxr==1.1.0 onnx==1.23.2 cryptography==50.0.2 \
        onnxruntime==1.32.0 \
    && pip uninstall -y onnxruntime onnxruntime-gpu \
    && pip install --no-cache-dir --no-deps "onnxruntime-gpu==${ORT_GPU_VERSION}" \
    && python -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" \
    && mkdir -p /src/voices

FROM ${BASE_IMAGE}
# The same Ubuntu Python as the builder's, so the copied venv finds its interpreter.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 splittts \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/splittts splittts \
    && mkdir -p /var/cache/split-tts \
    && chown 10001:10001 /var/cache/split-tts
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /src/voices /opt/split-tts/voices
# The fp16 ONNX export is made on first start and kept in SPLITTTS_CACHE (mount a volume there).
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    SPLITTTS_CACHE=/var/cache/split-tts
USER 10001:10001
WORKDIR /home/splittts
EXPOSE 50052 9092 50062
# grpc.health.v1 Check on this service's plaintext health-only port (--health-port), which
# answers whether or not the gRPC port runs TLS; exit 0 only when it says SERVING (after
# warm-up).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys,grpc;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;r=g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(h.HealthCheckRequest(service=sys.argv[2]),timeout=4);sys.exit(r.status!=h.HealthCheckResponse.SERVING)", "127.0.0.1:50062", "splittts.vocoder.v1.Vocoder"]
CMD ["vocoder-service", "--host", "0.0.0.0", "--port", "50052", "--metrics-port", "9092", \
     "--health-port", "50062", "--voice", "/opt/split-tts/voices/default", "--backend", "onnx", \
     "--fp16"]
