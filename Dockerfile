# The training image: one container per node. Its entrypoint, scripts/worker.sh, reads the
# rendezvous from the environment (NNODES, NODE_RANK, MASTER_ADDR, ... or a scheduler's variables)
# and starts torchrun; the default command trains the tiny model on the DummyDataset.
#
#   docker build -t distqa .
#   docker run --rm --gpus all --shm-size=8g -v "$PWD/results:/app/results" distqa   # every GPU of this host
#   docker run --rm -v "$PWD/results:/app/results" distqa                          # a CPU host: one process
# (Without -v the results stay in the container and go with it; the run warns of that.)
#
# `docker stop` (SIGTERM, SIGKILL 10 s later) is a preemption: the current step is checkpointed and
# the container exits 143. The tiny model's stop takes a few seconds; for a larger model give the
# step plus its checkpoint time: `docker run --stop-timeout 60` (no instruction here can set it).
#
# Built by plain `docker build` and by Kaniko on Neu.ro (`neuro-flow build train_image`), so no
# BuildKit-only syntax (RUN --mount) here.

# The base image brings Python, CUDA and the CUDA build of torch; its torch version must be the one
# requirements.txt pins (2.13.0). The default tag is taken from public uses of it, not pulled here:
# check it (`docker manifest inspect`) and pick the CUDA flavour your driver supports, e.g.
# --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# HF_HOME: mount a volume here (-v hf-cache:/cache/huggingface) to keep downloaded models.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface \
    HOME=/home/app

WORKDIR /app

# The pinned requirements, except that torch is pinned to the base image's own build
# (e.g. torch==2.13.0+cu126): pip then finds it installed and never fetches PyPI's wheel.
# The same file is the constraints file, so jupyterlab (for the Neu.ro `jupyter` job) cannot move a pin.
COPY requirements.txt ./
RUN torch_pin="torch==$(python -c 'import torch; print(torch.__version__)')" \
    && sed "s/^torch==.*/${torch_pin}/" requirements.txt > /tmp/requirements.txt \
    && grep -qx "${torch_pin}" /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt -c /tmp/requirements.txt jupyterlab==4.6.6 \
    && rm /tmp/requirements.txt

# The package itself; its dependencies are all installed above.
COPY pyproject.toml README.md ./
COPY src ./src
# (pip builds in the source tree: its build/ and egg-info are not needed in the image.)
RUN pip install --no-cache-dir --no-deps ./ && rm -rf build src/*.egg-info

COPY configs ./configs
COPY scripts ./scripts

# Writable places for the unprivileged user. World-writable (sticky) as well, so that
# `docker run --user "$(id -u):$(id -g)"` with a mounted results folder works for any host user.
RUN mkdir -p /app/data /app/results /cache/huggingface /home/app \
    && chown -R 1000:1000 /app/results /cache /home/app \
    && chmod 1777 /app/results /cache/huggingface /home/app

USER 1000:1000

ENTRYPOINT ["/app/scripts/worker.sh"]
CMD ["--config", "configs/quickstart.yaml", "output_dir=results/quickstart"]
