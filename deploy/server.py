"""One serving replica: its ``Router`` (target shard actors and drafter actor in the replica's placement
group, bundles 1..n) driven by a ``ServingLoop`` thread (``EngineReplica``), behind the HTTP API
(``deploy.openai_api``, built per replica) and the gRPC API (``deploy.grpc_api``) as ``DSparkServer``, or behind a
front door of its own deployment (``deploy.ingress``). This module only composes them; prompts and API
keys are never logged.
"""

from __future__ import annotations

import functools
import logging
import sys
import time

import torch
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.util import get_current_placement_group

from actors.admission import Overloaded
from actors.collective import node_id
from actors.router import Router
from actors.serving_loop import Event, ServingLoop, Unavailable
from actors.speculation_switch import SpeculationSwitch
from actors.target_actor import vllm_target
from actors.telemetry import ReplicaTelemetry
from actors.tracing import RequestTracer, make_provider
from deploy.auth import KeyCheck, read_api_key, require_key_or_consent
from deploy.grpc_api import GrpcApi
from deploy.openai_api import build_http_app
from deploy.placement import drafter_bundle
from deploy.request_adapter import RequestAdapter
from dspark.builder import describe
from dspark.config import SamplingParams
from dspark.schema import EngineFileConfig
from dspark.training.prepare import default_target_dir, prepare_target

log = logging.getLogger("dspark.server")


@functools.cache
def replica_id() -> str:
    """This Serve replica's id ("local" outside a replica)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return "local"


def http_proxy_host() -> str | None:
    """The host Serve's HTTP proxies bind (``http_options.host``); None if it cannot be read.
    Ray 2.60: the controller's ``get_http_config``, through the private Serve client."""
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception:  # noqa: BLE001  (a private API: treat any failure as unknown, which is not loopback)
        return None


class EngineReplica:
    """One engine replica: its router and serving loop, telemetry and health. Serves the API itself as
    ``DSparkServer``; behind a front door of its own deployment (``deploy.ingress``) it is deployed as it is, and
    the front door streams each request's events from :meth:`generate_events`."""

    def __init__(self, config: EngineFileConfig):
        self.config, self.spec = config, config.serving
        key = read_api_key(config.serving)
        require_key_or_consent(config.serving, key, http_proxy_host())
        self.keys = KeyCheck(key)
        self.replica_id = replica_id()
        if config.resolve(config.target.path) == default_target_dir():
            prepare_target()  # the embedded default converts itself on first start (no-op when cached)
        # The loop thread and the request handlers share the GIL; with CPython's default 5 ms switch interval a
        # handler formatting a chunk can hold the next step back for up to 5 ms (per token at concurrency 1).
        sys.setswitchinterval(0.0005)
        if config.engine.backend == "vllm":  # vLLM's engine in this process: it computes here
            # threads: OMP_NUM_THREADS from the deployment (deploy.ray_app.replica_threads_env); vLLM binds them;
            # the drafter actor (engine.vllm_drafter: actor) takes the last bundle of the replica's placement group
            self.router = vllm_target(config, get_current_placement_group(), drafter_bundle=drafter_bundle(config))
        else:
            placement = get_current_placement_group()
            torch.set_num_threads(config.runtime.router_threads)  # the router only batches; actors compute
            self.router = Router(config, placement=placement, bundle_offset=1 if placement else 0)
        if getattr(self.router, "description", None) is None:  # the native router (the vLLM engine has its own)
            self.router.description = describe(config, self.router)
            log.info("engine: %s", self.router.description)
        self.tokenizer = self.router.tokenizer
        self.adapter = RequestAdapter(config, self.tokenizer, self.router.target.config.vocab_size)
        self.telemetry = ReplicaTelemetry(config.name)
        spec = self.spec
        switch = (SpeculationSwitch(self.router, probe_interval_s=spec.speculation_probe_interval_s)
                  if spec.load_aware_speculation and self.router.drafter is not None else None)
        provider = make_provider(spec.tracing, spec.otlp_endpoint, service=f"dspark/{config.name}")
        self.loop = ServingLoop(self.router, spec.max_concurrent_requests, spec.max_queued_requests,
                                telemetry=self.telemetry, switch=switch,
                                tracer=RequestTracer(provider) if provider else None,
                                max_queued_tokens=spec.max_queued_tokens, request_timeout_s=spec.request_timeout_s,
                                cpus=config.runtime.engine_cpus)
        self.created = int(time.time())

    async def generate_events(self, prompt_ids: list[int], params: SamplingParams, speculate: bool = True):
        """The engine side of a front door in its own deployment (``serving.front_door: deployment``,
        ``deploy.carry_over``): the request's events, ``accepted`` first, up to ``finished``, streamed over a
        Serve handle; a refusal or failure is an ``error`` event. A caller that stops listening cancels it."""
        try:
            request_id, queue = self.loop.submit(prompt_ids, params, speculate)
        except (Overloaded, Unavailable) as exc:
            yield Event("error", [], error=exc)
            return
        done = False
        try:
            while not done:
                event: Event = await queue.get()
                done = event.kind in ("finished", "error")
                yield event
        finally:
            if not done:
                self.loop.cancel(request_id)

    def metrics_text(self) -> str:
        """This replica's Prometheus exposition (what GET /metrics answers when it serves the API itself)."""
        return self.telemetry.prometheus_text().decode()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by Serve every ``metrics_interval_s`` for ``deploy.autoscaling.AcceptanceLengthPolicy``."""
        return self.loop.autoscaling_stats()

    def check_health(self) -> None:
        """Serve's health check: a dead loop thread, or a step stuck past twice the target's deadline, fails it
        (Serve then replaces the replica). ``recovering`` passes: the replica is restarting its own actors."""
        state = self.loop.state
        if state in ("broken", "stalled"):
            raise RuntimeError(f"serving loop {state}")

    def health_details(self) -> dict:
        """What GET /health adds for a caller with the API key."""
        return {"replica": self.replica_id, "actors": self.router.actor_pids,
                "nodes": {"replica": node_id(), **self.router.actor_nodes},
                "speculation_enabled": self.router.speculation_enabled, "dtypes": self.router.dtypes,
                "engine": self.router.description, "draft_sources": getattr(self.router, "draft_sources", None),
                "speculation_switch": self.loop.switch.describe() if self.loop.switch is not None else None,
                **self.loop.snapshot(), "autoscaling": self.loop.autoscaling_stats()}

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.close()
            self.adapter.close()
            self.router.shutdown()


@serve.deployment
@serve.ingress()
class DSparkServer(EngineReplica, GrpcApi):
    """An engine replica that serves the HTTP and gRPC API itself (``serving.front_door: in_replica``)."""

    def __serve_build_asgi_app__(self):  # noqa: N802  (Serve builds the HTTP app per replica, after __init__)
        return build_http_app(self)
