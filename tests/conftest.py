"""Shared fixtures: small real checkpoints made with transformers, prompts from the repo's benchmarks/data/."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
import torch

from dspark.config import EngineConfig
from dspark.decoding.drafter import DSparkDrafter
from dspark.decoding.engine import Engine
from dspark.decoding.scheduler import StepCostProfile
from dspark.evaluation.prompt_sets import read_prompts
from dspark.formats.checkpoint import save_draft
from dspark.formats.target_checkpoint import load_target
from dspark.loader import load_tokenizer
from dspark.model.draft_model import DSparkDraft
from dspark.schema import EngineFileConfig, load_engine_config, write_variant
from dspark.testing import make_tiny_target, tiny_draft_config
from dspark.training.prepare import prepare_target

REPO = Path(__file__).resolve().parents[1]
HTTP = "http://127.0.0.1:8000"  # Serve's HTTP proxy (serve_instance)
GRPC = "127.0.0.1:9000"  # Serve's gRPC proxy
KEY = "test-key-123"  # the API key of the apps that use one (get_health presents it: /health's details need it)
GRPC_MAX_MESSAGE_BYTES = 4 << 20  # the gRPC proxy's cap (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE), as in `make serve`
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def benchmark_prompts(name: str, limit: int) -> list[str]:
    """The first ``limit`` prompts of a prompt set the repo carries (a missing file fails the test)."""
    return read_prompts(name, limit)


def stdlib_texts(limit: int = 40) -> list[str]:
    """Tokenizer training text that overlaps no benchmark: the Python standard library's sources."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(lib.glob("*.py"))[:limit]
    return [f.read_text(errors="ignore")[:20000] for f in files]


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A random 4-layer Llama in float64 (exact comparisons) with a trained BPE tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_target(path, stdlib_texts(), vocab_size=512, dtype=torch.float64)


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    return load_target(tiny_target_dir, "float64")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    return load_tokenizer(tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_target) -> Path:
    torch.manual_seed(1)
    draft = DSparkDraft(tiny_draft_config(tiny_target.config, block_size=4))
    path = tmp_path_factory.mktemp("tiny-draft")
    save_draft(draft, path)
    return path


FLAT_PROFILE = StepCostProfile((1, 64), (0.01, 0.0101), 0.0)  # verification nearly free: keep long prefixes


def make_engine(target, tokenizer, drafter=None, profile=FLAT_PROFILE, **overrides) -> Engine:
    cfg = EngineConfig(**{"max_num_seqs": 8, "kv_cache_tokens": 8192, "dtype": "float64", **overrides})
    layers = drafter.model.config.target_layer_ids if isinstance(drafter, DSparkDrafter) else ()
    return Engine(target, tokenizer, drafter, cfg, feature_layers=layers, profile=profile)


def embedded_exact() -> EngineFileConfig:
    """configs/embedded.yaml in bf16: the batch-invariant mode, where speculative greedy output equals plain greedy
    output bit for bit on any CPU (its ``auto`` dtype is fp32 on CPUs without native bf16, exact only up to
    near-ties: ``benchmarks/near_ties.py``). Tests that compare outputs across execution shapes use this. On the
    native engine (the reference; the shipped default serves on vLLM)."""
    cfg = load_engine_config(REPO / "configs" / "embedded.yaml")
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"backend": "native"}),
                                  **{part: getattr(cfg, part).model_copy(update={"dtype": "bfloat16"})
                                     for part in ("target", "draft")}})


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RAY_METRICS_PORT = free_port()  # the node's metrics agent: Prometheus text of every ray.util.metrics series
# Local clusters of this suite (the session's, `serve run`'s, the scripts' own: tests/vllm_generate.py with a drafter
# actor, tests/cluster_run.py) run without Ray's token authentication, whichever module runs first or alone.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (2 logical CPUs; actors take fractions)."""
    import ray

    os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(GRPC_MAX_MESSAGE_BYTES)  # read by the proxies Serve starts
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=RAY_METRICS_PORT)
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_instance(ray_cluster):
    """Ray Serve started once per session with HTTP on 127.0.0.1:8000 and gRPC on :9000 (fixed ports)."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": 8000},
                grpc_options={"port": 9000, "enable_reflection": False, "grpc_servicer_functions": [
                    "dspark.v1.serving_pb2_grpc.add_DSparkServicer_to_server",
                    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"]})
    return serve


def wait_for(probe: Callable, timeout_s: float, what: str, until: Callable = bool, interval_s: float = 0.2,
             ignore: tuple[type[BaseException], ...] = ()):
    """Poll ``probe()`` until ``until(value)`` holds and return that value; past ``timeout_s`` fail naming ``what``
    and the last value observed. Exceptions of the ``ignore`` types count as not yet (a replica restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = probe()
            if until(value):
                return value
        except ignore as exc:
            value = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; last observed: {value!r}")
        time.sleep(interval_s)


def holds(probe: Callable, duration_s: float, what: str, until: Callable = bool, interval_s: float = 1.0) -> None:
    """``until(probe())`` holds at every poll for ``duration_s``; fails at the first poll where it does not."""
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        value = probe()
        assert until(value), f"expected {what}; observed {value!r}"
        time.sleep(interval_s)


def get_health(route_prefix: str = "/", timeout_s: float = 30) -> dict:
    """GET /health with the suite's key (its details need it where the app has a key; ignored where not)."""
    return requests.get(f"{HTTP}{route_prefix.rstrip('/')}/health", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=timeout_s).json()


def _test_defaults(sections: dict) -> dict:
    """What the served tests change in configs/embedded.yaml unless a section says otherwise: bf16 target and draft
    (the exact mode, see ``embedded_exact``), and the native engine (the reference: most served tests compare the
    replies with ``build_engine``'s in-process native output; the vLLM tests, the front door and the fuzz suite
    pick ``engine.backend: vllm``, which serves the shipped default's vLLM settings)."""
    sections = sections | {part: {"dtype": "bfloat16", **sections.get(part, {})} for part in ("target", "draft")}
    return sections | {"engine": {"backend": "native", **sections.get("engine", {})}}


@contextlib.contextmanager
def deploy_app(tmp_dir: Path, name: str = "dspark", route_prefix: str = "/",
               **sections: dict) -> Iterator[EngineFileConfig]:
    """configs/embedded.yaml with some sections updated (``serving={...}``, ...), deployed by deploy.ray_app as
    the Serve application ``name`` (needs serve_instance); yields its config once /health answers, then deletes it.
    Target and draft run in bf16 on the native engine unless a section says otherwise (``_test_defaults``)."""
    from ray import serve

    from deploy.ray_app import build_app

    prepare_target()
    sections = _test_defaults(sections)
    path = write_variant(load_engine_config(REPO / "configs" / "embedded.yaml"), Path(tmp_dir) / f"{name}.yaml",
                         **sections)
    serve.run(build_app({"config": str(path)}), name=name, route_prefix=route_prefix)
    try:
        wait_for(lambda: get_health(route_prefix, 10), 180, f"application {name!r} to answer /health",
                 until=lambda health: health.get("status") == "ok", ignore=(requests.RequestException,))
        yield load_engine_config(path)
    finally:
        serve.delete(name)


class ServeRun:
    """A ``serve run`` process (the real CLI, its own local Ray cluster) on its own ports, with its output kept."""

    def __init__(self, proc: subprocess.Popen, http: str, grpc: str, config: EngineFileConfig | None):
        self.proc, self.http, self.grpc, self.config = proc, http, grpc, config
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # serve run deletes its app and stops its cluster
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._reader.join(timeout=10)


def _ctrl_c_stops() -> None:
    """In the ``serve run`` child: SIGINT raises KeyboardInterrupt (``stop``'s Ctrl-C), also where this suite was
    started in the background by a non-interactive shell, which starts it with SIGINT ignored; a child inherits
    that, and ``serve run`` then sat out ``stop``'s 60 s before being killed (measured: 60.1 s per teardown)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def serve_run(tmp_dir: Path, http_port: int, grpc_port: int, host: str = "127.0.0.1", wait_ready: bool = True,
              **sections: dict) -> Iterator[ServeRun]:
    """``serve run`` of a Serve config like configs/serve.yaml (the embedded default, bf16: see ``embedded_exact``,
    sections updated as in ``deploy_app``) with HTTP on ``host:http_port`` and gRPC on ``grpc_port``, in a Ray
    cluster of its own (``--address local``); yields once /health answers ok (``wait_ready``), then Ctrl-C."""
    import yaml

    prepare_target()
    sections = _test_defaults(sections)
    engine_path = write_variant(load_engine_config(REPO / "configs" / "embedded.yaml"), Path(tmp_dir) / "engine.yaml",
                                **sections)
    serve_config = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    serve_config["http_options"] = {"host": host, "port": http_port}
    serve_config["grpc_options"]["port"] = grpc_port
    serve_config["applications"][0].update(import_path="deploy.ray_app:build_app", args={"config": str(engine_path)})
    path = Path(tmp_dir) / "serve.yaml"
    path.write_text(yaml.safe_dump(serve_config))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(GRPC_MAX_MESSAGE_BYTES),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", "--address", "local", str(path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True, preexec_fn=_ctrl_c_stops)
    run = ServeRun(proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", load_engine_config(engine_path))
    try:
        if wait_ready:
            def health():
                assert proc.poll() is None, f"serve run exited ({proc.returncode}):\n{run.output[-3000:]}"
                return requests.get(f"{run.http}/health", timeout=10).json()

            wait_for(health, 300, f"serve run to answer /health on :{http_port}",
                     until=lambda h: h.get("status") == "ok", interval_s=1, ignore=(requests.RequestException,
                                                                                   ValueError))
        yield run
    finally:
        run.stop()


def assert_vllm_reads_as_we_do(config_file: Path) -> dict:
    """The installed vLLM's reading of a draft config.json equals ours (layer ids, block layout, vocabulary, ...)."""
    from dspark.formats.checkpoint import draft_config_from_json
    from dspark.integrations.vllm_0_32.formats import our_draft_view, vllm_draft_view

    data = json.loads(Path(config_file).read_text())
    ours, theirs = our_draft_view(draft_config_from_json(data)), vllm_draft_view(data)
    assert theirs == ours, f"{config_file}: vLLM {theirs} != ours {ours}"
    return ours


@pytest.fixture(scope="session")
def plain_vllm_fp32(tmp_path_factory) -> dict:
    """Plain vLLM's fp32 greedy replies to the 20 shared chat prompts, one request at a time, with the embedded
    default's engine settings (``vllm_runs.fp32_vllm_config``, speculation off): the reference of both vLLM test
    modules (vLLM + our proposer against it; the native engine against it), run once per session."""
    from dspark.integrations.vllm_0_32.args import engine_arguments

    from vllm_runs import GREEDY, fp32_vllm_config, shared_prompts, vllm_generate, with_speculation

    prepare_target()
    config = with_speculation(fp32_vllm_config(), "off")
    prompts = shared_prompts(load_tokenizer(config.resolve(config.target.path)))
    run = vllm_generate(engine_arguments(config), prompts, [GREEDY], tmp_path_factory.mktemp("plain-vllm-fp32"))[0]
    return {"prompts": prompts, "outputs": run["outputs"], "spec": run["spec"]}
