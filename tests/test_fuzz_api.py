"""Property-based fuzzing of the HTTP API from its own OpenAPI schema: no input gives a 5xx.

Bounded: a fixed number of generated requests per operation, each with a timeout, against
the loopback server of ``test_serving`` (same module-scoped app fixture, imported here).
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings

from deploy.openai_api import build_http_app

from test_serving import HTTP, KEY, served  # noqa: F401  (the running app fixture)

pytestmark = pytest.mark.slow
api = build_http_app(None)  # the routes and schema every replica serves
schema = schemathesis.openapi.from_dict(api.openapi())


def test_the_server_serves_its_openapi_schema(served):  # noqa: F811
    assert requests.get(f"{HTTP}/openapi.json", timeout=30).status_code == 401  # the schema needs the key too
    served_schema = requests.get(f"{HTTP}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert set(served_schema["paths"]) == {"/health", "/metrics", "/v1/models", "/v1/completions",
                                           "/v1/chat/completions"}
    assert served_schema["paths"] == api.openapi()["paths"]


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_causes_a_server_error(case, served):  # noqa: F811
    response = case.call(base_url=HTTP, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code < 500, (case.body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
