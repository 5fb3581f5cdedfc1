"""The front door as its own Serve deployment (``serving.front_door: deployment``): the same HTTP and gRPC API,
auth and bounds as a replica that serves them itself (``deploy.openai_api``, ``deploy.grpc_api``, the request
adapter), in front of the engine replicas (``deploy.server.EngineReplica``, reached through a Serve handle), as
Ray Serve LLM splits its ingress from its engine servers. What the split buys: a request's state (its prompt and
the tokens sent) lives here, so a lost engine replica's requests are carried over to a live one
(``deploy.carry_over``); what it costs: one more hop per event, measured in ``docs/performance.md``.

``GET /health`` (with the key) and ``GET /metrics`` answer from one engine replica (as a replica serving the API
itself answers for itself), with this front door's own details beside: its node and the carry-overs counted here
(``dspark:request_carry_overs_total`` in the exposition).
"""

from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, Counter, generate_latest
from ray import serve

from actors.collective import node_id
from deploy.auth import KeyCheck, read_api_key, require_key_or_consent
from deploy.carry_over import RemoteLoop
from deploy.grpc_api import GrpcApi
from deploy.openai_api import build_http_app
from deploy.request_adapter import RequestAdapter
from deploy.server import http_proxy_host, replica_id
from dspark.loader import load_tokenizer
from dspark.schema import EngineFileConfig
from dspark.training.prepare import default_target_dir, prepare_target


@serve.deployment
@serve.ingress()
class DSparkFrontDoor(GrpcApi):
    def __init__(self, config: EngineFileConfig, engine):
        self.config, self.spec = config, config.serving
        key = read_api_key(config.serving)
        require_key_or_consent(config.serving, key, http_proxy_host())
        self.keys = KeyCheck(key)
        self.replica_id = replica_id()
        target = config.resolve(config.target.path)
        if target == default_target_dir():
            prepare_target()  # the tokenizer of the embedded default (no-op when cached)
        self.tokenizer = load_tokenizer(target)
        vocab_size = json.loads((target / "config.json").read_text()).get("vocab_size", len(self.tokenizer))
        self.adapter = RequestAdapter(config, self.tokenizer, vocab_size)
        self.engine = engine
        self.registry = CollectorRegistry()
        self.carry_over_counter = Counter("dspark:request_carry_overs", "Requests carried over to another replica "
                                          "after losing theirs", ["model_name"], registry=self.registry)
        self.loop = RemoteLoop(engine, config.serving.carry_over_limit,
                               config.serving.carry_over_max_tokens,
                               on_carry_over=self.carry_over_counter.labels(config.name).inc)
        self.telemetry = self  # GET /metrics: prometheus_text
        self.created = int(time.time())

    def __serve_build_asgi_app__(self):  # noqa: N802
        return build_http_app(self)

    async def prometheus_text(self) -> bytes:
        engine = await self.engine.metrics_text.remote()
        return engine.encode() + generate_latest(self.registry)

    async def health_details(self) -> dict:
        details = await self.engine.health_details.remote()
        return {**details, "front_door": {"replica": self.replica_id, "node": node_id(),
                                          "carry_overs": self.loop.carry_overs}}
