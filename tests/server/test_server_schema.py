"""A bounded, pinned schemathesis run against a live server: no response >= 500 and every error body
OpenAI-shaped, for requests generated from the server's own OpenAPI schema (which documents 400, 401, 404,
413, 429, 503, 504, never 422)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from kvserve.server.app import build_app
from kvserve.server.serving import ServingOptions
from tests.server_utils import running_server

pytestmark = pytest.mark.slow

# The schema comes from the app itself (building it loads no model); requests go to a live server.
SCHEMA_DICT = build_app(lambda: None, ServingOptions(served_model_name="m")).openapi()
schema = schemathesis.openapi.from_dict(SCHEMA_DICT)
EXAMPLES_PER_OPERATION = 25  # x 12 operations: about 300 cases


@pytest.fixture(scope="module")
def live(gpt2_model_dir):
    args = ("--max-model-len", "64", "--kv-cache-memory", "8MiB", "--max-n", "2")
    with running_server(gpt2_model_dir, *args) as (url, _):
        yield url


def test_schema_documents_real_statuses():
    for path, operations in SCHEMA_DICT["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
    completions = SCHEMA_DICT["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "429", "503", "504"} <= set(completions)
    body = SCHEMA_DICT["components"]["schemas"]["CompletionRequest"]["properties"]
    assert body["echo"].get("const") is False or body["echo"].get("enum") == [False]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors_and_openai_shaped_errors(case, live):
    response = case.call(base_url=live, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text[:300]
        assert isinstance(error["message"], str) and error["message"]
    assert httpx.get(f"{live}/health").status_code == 200
