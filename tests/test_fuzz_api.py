"""Property-based fuzzing of the HTTP API from its own OpenAPI schema: no input gives a 5xx, on either engine backend.

Bounded: a fixed number of generated requests per operation, each with a timeout, against the embedded default
deployed in the session's Serve instance with an API key and small limits, on the native engine and then on vLLM's.
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings

from deploy.openai_api import build_http_app

from conftest import HTTP, KEY, deploy_app, get_health

pytestmark = pytest.mark.slow
api = build_http_app(None)  # the routes and schema every replica serves
schema = schemathesis.openapi.from_dict(api.openapi())


@pytest.fixture(scope="module", params=["native", "vllm"])
def served(request, serve_instance, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(KEY + "\n")
    with deploy_app(tmp_path_factory.mktemp("config"), engine={"backend": request.param, "max_num_seqs": 4},
                    serving={"load_aware_speculation": False, "api_key_file": str(key_file),
                             "max_concurrent_requests": 4, "max_queued_requests": 2, "max_tokens_limit": 64,
                             "max_prompt_tokens": 512}) as config:
        assert get_health()["dtypes"]["target"].get("backend", "native") == request.param
        yield config


def test_the_server_serves_its_openapi_schema(served):
    assert requests.get(f"{HTTP}/openapi.json", timeout=30).status_code == 401  # the schema needs the key too
    served_schema = requests.get(f"{HTTP}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert set(served_schema["paths"]) == {"/health", "/metrics", "/v1/models", "/v1/completions",
                                           "/v1/chat/completions"}
    assert served_schema["paths"] == api.openapi()["paths"]


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_causes_a_server_error(case, served):
    response = case.call(base_url=HTTP, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code < 500, (case.body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
