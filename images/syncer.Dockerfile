# ddiloco syncer image: slim, CPU-only PyTorch (the syncer merges fragments in fp32 on CPU). Also runs
# prepare, chaos and report, and every step of the CPU `smoke` pipeline. Build from the repository root:
#   images/build.sh REGISTRY            (or: docker build -f images/syncer.Dockerfile .)
ARG PYTHON=python:3.11-slim-bookworm

FROM ${PYTHON} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ddiloco ./ddiloco
COPY components ./components
COPY pipelines ./pipelines
# The image's lock (exact versions and file hashes of '.[kfp,lm-eval,data,mlflow]', requirements/lock.sh); the wheel is
# built with the lock's setuptools, installed from its hashed entry.
COPY requirements/syncer.lock /wheels/requirements.lock
RUN awk '/^setuptools==/{p=1} p{print} p && !/\\$/{exit}' /wheels/requirements.lock > /tmp/build.lock \
 && pip install --require-hashes --no-deps -r /tmp/build.lock \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${PYTHON}
# PyTorch's CPU-only wheels (no CUDA libraries): ~10x smaller than the default Linux wheel.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
COPY --from=build /wheels /wheels
# The lock's torch is the CPU build (X+cpu), which PyTorch's index serves; everything else comes from PyPI.
RUN python -m venv /opt/venv \
 && pip install --require-hashes --no-deps --extra-index-url "${TORCH_INDEX}" -r /wheels/requirements.lock \
 && pip install --no-deps /wheels/ddiloco-*.whl \
 && pip check \
 && rm -rf /wheels \
 && useradd --uid 1000 --create-home --shell /usr/sbin/nologin ddiloco
USER 1000:1000
# Pods run as 1000 (components/podsettings.py RUN_AS, Pod Security `restricted`): HOME and the caches the code
# and its libraries write (Hugging Face, torch/triton kernels) are this user's; tempfile uses /tmp (1777).
ENV HOME=/home/ddiloco XDG_CACHE_HOME=/home/ddiloco/.cache HF_HOME=/home/ddiloco/.cache/huggingface
WORKDIR /home/ddiloco
# KFP runs `python3 -m kfp.dsl.executor_main ...`; python3 is the venv's (first on PATH).
RUN python3 -c "import ddiloco, kfp, torch; print('ddiloco', ddiloco.__version__, 'torch', torch.__version__)"
CMD ["ddiloco", "--help"]
