"""Fuzz every route of the server's own OpenAPI document with schemathesis (hypothesis),
under all of schemathesis' default checks, not only "no 5xx": a status the document does
not list, a body or content type it does not describe, a schema-valid request rejected
(positive data) or a schema-violating one accepted (negative data) each fail the test.

Bounded: each route gets a fixed number of positive and of negative examples. Positive
chat/completion cases get a small max_tokens and are kept inside the context window,
counted with the server's own /tokenize, and their output constraint made one that compiles
(tests/schemathesis_hooks.py lists these rules no JSON schema can state; every other rule, one
output constraint at most among them, is in the document).

The examples are derandomized, so CI runs the same cases every time. To explore new cases,
run with BRISK_FUZZ_RANDOM=1 as often as you like (a random run may draw no valid chat body
and fail the coverage check at the end; every other failure is a server or document bug)."""

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from brisk.config import CacheConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.scheduler import SchedulerConfig

from live_server import serve_engine
from schemathesis_hooks import MAX_NEW, fit_positive_case  # noqa: F401 (MAX_NEW: the bound it applies)

pytestmark = pytest.mark.slow  # schemathesis over the whole OpenAPI document: `pytest -m 'not slow'` skips it locally

WINDOW = 128
EXAMPLES = 30


@pytest.fixture(scope="module")
def fuzz_server(demo):
    engine = LLMEngine(demo, CacheConfig(block_size=16, num_gpu_blocks_override=128),
                       SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=WINDOW))
    with serve_engine(engine, max_request_bytes=64 * 1024) as live:
        yield live


def test_openapi_document_passes_every_default_check(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", config=CHECKS)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/tokenize",
                                              "/detokenize", "/metrics", "/health", "/ready", "/v1/models"}
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        for operation in operations:
            if _schema_refuses_all(schema, operation):
                # a route this model does not serve (/v1/embeddings for a generative model) has `not: {}` as its
                # body in the document: no case is valid and schemathesis can draw none, valid or not; every
                # body is refused with one clear error
                _check_refused(operation, http)
                continue
            for mode in [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.body else []):
                check_operation(operation, mode, fuzz_server.url, http)
        metrics = http.get("/metrics").text
    seen = {(s.labels["route"], s.labels["status"]) for f in text_string_to_metric_families(metrics)
            if f.name == "brisk:http_responses" for s in f.samples if s.value > 0}
    assert not any(status.startswith("5") for _, status in seen)
    # the fuzzer reached generation (200) and validation (400) on both generation routes
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert {(route, "200"), (route, "400")} <= seen, seen


# schemathesis' default statuses that count as rejecting invalid data, plus 413: the fuzzer
# can build a body over --max-request-bytes, and refusing it for its size is a rejection
CHECKS = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": [
    "400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]}}})

def _schema_refuses_all(schema, operation) -> bool:
    """Whether the operation's JSON body schema is `not: {}` (inline, as schemathesis bundles it, or behind a $ref)."""
    for body in operation.body:
        definition = body.definition.get("schema", {})
        ref = definition.get("$ref", "")
        if ref.startswith("#/x-bundled/"):
            definition = definition.get("x-bundled", {}).get(ref.rpartition("/")[2], {})
        elif ref.startswith("#/components/schemas/"):
            definition = schema.raw_schema["components"]["schemas"].get(ref.rpartition("/")[2], {})
        if definition.get("not") == {}:
            return True
    return False


def _check_refused(operation, http: httpx.Client) -> None:
    for body in ({}, {"model": "x", "input": "hi"}, {"input": ["a", "b"], "encoding_format": "base64"}, [], "x"):
        response = http.request(operation.method.upper(), operation.path, json=body)
        assert 400 <= response.status_code < 500, (operation.path, body, response.status_code)
        assert response.json()["error"]["message"]


def check_operation(operation, mode, base_url: str, http: httpx.Client) -> None:
    generation = operation.path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=os.environ.get("BRISK_FUZZ_RANDOM") != "1")
    def all_checks(case):
        if generation and mode is GenerationMode.POSITIVE:
            assume(fit_positive_case(case.path, case.body, http, WINDOW))
        response = case.call_and_validate(base_url=base_url, timeout=60)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and "Traceback" not in error["message"]

    all_checks()
