# syntax=docker/dockerfile:1
# The training image of CPU instance types (m5.2xlarge: scoring, tests): pinflow on the AWS Deep Learning
# Container for PyTorch, CPU flavour, so that CPU and GPU jobs run the same Python, layout and entry point.
#
#   docker build -f deploy/training-cpu.Dockerfile -t <account>.dkr.ecr.<region>.amazonaws.com/pinflow-training-cpu:<tag> .
#   # then images.cpu in config/platform.yaml names it
ARG DLC_IMAGE=public.ecr.aws/deep-learning-containers/pytorch:2.13-cpu-amzn2023
FROM ${DLC_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PINFLOW_HOME=/opt/pinflow/home
WORKDIR /opt/pinflow/src
COPY pyproject.toml constraints.txt README.md ./
COPY core ./core
COPY operators ./operators
COPY features ./features
COPY training ./training
COPY config ./config
# The DLC's CPU torch 2.13.0 satisfies the pin (constraints.txt); see training.Dockerfile for the Python note.
# TorchRec with the CPU fbgemm (pinned in constraints.txt), torchrec itself --no-deps (it declares the CUDA fbgemm-gpu).
RUN pip install --ignore-requires-python -c constraints.txt ".[inference]" "fbgemm-gpu-cpu==1.8.0" \
 && pip install --ignore-requires-python --no-deps -c constraints.txt torchrec==1.8.0 \
 && python -c "import ray.data, torch, torchrec, fbgemm_gpu, training.launch, training.train, training.ray_inference; assert torch.__version__.startswith('2.13.0'), torch.__version__"
WORKDIR /opt/pinflow
