# syntax=docker/dockerfile:1
# The training image of GPU nodes (p5, p4d, g5): pinflow on an AWS Deep Learning Container for PyTorch.
#
#   docker build -f deploy/training.Dockerfile -t <account>.dkr.ecr.<region>.amazonaws.com/pinflow-training:<tag> .
#   # then images.gpu in config/platform.yaml (or an instance type's image) names it
#
# The DLC ships what multi-node training on AWS needs, as AWS builds and tests it: CUDA, PyTorch 2.13 (the
# version constraints.txt pins), NCCL, the EFA installer (libfabric, /opt/amazon/efa) and the aws-ofi-nccl
# plugin (/opt/amazon/ofi-nccl) on LD_LIBRARY_PATH, and nccl-tests' all_reduce_perf. pinflow adds no network
# stack of its own; the jobs set the EFA environment (FI_PROVIDER=efa, FI_EFA_FORK_SAFE=1, ...).
# Its entry point runs the CUDA forward-compatibility check, then execs the job's command
# (python -m training.launch ...); a Batch job runs it under an init process (initProcessEnabled).
ARG DLC_IMAGE=public.ecr.aws/deep-learning-containers/pytorch:2.13-cu133-amzn2023
FROM ${DLC_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PINFLOW_HOME=/opt/pinflow/home
WORKDIR /opt/pinflow/src
COPY pyproject.toml constraints.txt README.md ./
COPY core ./core
COPY operators ./operators
COPY features ./features
COPY training ./training
COPY config ./config
# Into the DLC's own environment (/opt/venv), with the pinned versions: its torch 2.13.0 (CUDA build) already
# satisfies the pin and stays. The DLC's Python is 3.12 and pyproject.toml still says <3.12, hence
# --ignore-requires-python (the code has no 3.11-only construct); the check below proves the pieces load.
# TorchRec (strategy torchrec): the CUDA fbgemm-gpu 1.8.0 (the extra `cuda`; 1.8 pairs with torch 2.13), then
# torchrec itself with --no-deps, as on CPU nodes (never fbgemm-gpu-cpu here: both install the module fbgemm_gpu).
RUN pip install --ignore-requires-python -c constraints.txt ".[inference]" "fbgemm-gpu==1.8.0" \
 && pip install --ignore-requires-python --no-deps -c constraints.txt torchrec==1.8.0 \
 && python -c "import ray.data, torch, torchrec, fbgemm_gpu, training.launch, training.train, training.ray_inference; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
 && test -e /opt/amazon/efa/bin/fi_info
WORKDIR /opt/pinflow
