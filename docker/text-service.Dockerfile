# syntax=docker/dockerfile:1
# text-service: the speech LM engine on an Ascend NPU (torch_npu over CANN). Build from the
# repository root:
#   docker build -f docker/text-service.Dockerfile -t split-tts/text-service:0.3.0 .
# BASE_IMAGE must carry the CANN release that torch-npu 2.13.0 was built against, and Python 3.11.
ARG BASE_IMAGE=ascendai/cann:9.1.0-910b-ubuntu22.04-py3.11

FROM ${BASE_IMAGE} AS builder
# torch_npu runs on the CPU build of torch; the default index would pull a CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH}
# --system-site-packages: keep whatever Python packages the CANN image ships visible.
RUN python3 -m venv --system-site-packages /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
    && pip install --no-cache-dir grpcio-tools==1.85.1 protobuf==7.36.2
WORKDIR /src
COPY . .
# Generated gRPC code is never committed: compile it here so the wheel carries splittts/.
# The second group of pins is what CANN's operator compiler imports at run time.
RUN python protos/generate.py . \
    && pip install --no-cache-dir "/src[npu]" torch-npu==2.13.0 \
        grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
        numpy==2.4.6 safetensors==0.8.0 transformers==5.24.0 tokenizers==0.23.3 \
        prometheus-client==0.26.0 soundfile==0.14.0 soxr==1.1.0 onnx==1.23.2 cryptography==50.0.2 \
        onnxruntime==1.32.0 \
        attrs==26.1.0 decorator==5.3.1 sympy==1.14.0 psutil==7.2.2 scipy==1.17.1 \
        absl-py==2.5.1 cloudpickle==3.1.2 tornado==6.6.1 \
    && mkdir -p /src/voices

FROM ${BASE_IMAGE}
# Ascend device nodes belong to the driver's HwHiAiUser group (gid 1000 unless the host's
# driver was installed with another): the service user joins it to open /dev/davinci*.
ARG ASCEND_GID=1000
RUN { getent group "${ASCEND_GID}" >/dev/null || groupadd --gid "${ASCEND_GID}" HwHiAiUser; } \
    && groupadd --system --gid 10001 splittts \
    && useradd --system --uid 10001 --gid 10001 --groups "${ASCEND_GID}" \
        --create-home --home-dir /home/splittts splittts
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /src/voices /opt/split-tts/voices
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
USER 10001:10001
# CANN writes operator caches and logs under the working directory and $HOME.
WORKDIR /home/splittts
EXPOSE 50051 9091 50061
# grpc.health.v1 Check on this service's plaintext health-only port (--health-port), which
# answers whether or not the gRPC port runs TLS; exit 0 only when it says SERVING (after
# warm-up).
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys,grpc;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;r=g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(h.HealthCheckRequest(service=sys.argv[2]),timeout=4);sys.exit(r.status!=h.HealthCheckResponse.SERVING)", "127.0.0.1:50061", "splittts.text.v1.TextGeneration"]
# No ENTRYPOINT here: the CANN image's own entrypoint sources the toolkit's set_env.sh scripts,
# then runs this command.
CMD ["text-service", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9091", \
     "--health-port", "50061", "--model", "/opt/split-tts/voices/default/lm", "--device", "npu"]
