"""Fixtures of the tests that run the server on the tiny model (registered in conftest.py).

Session servers shared by the API-surface tests: `api_server` (auto tool choice with the hermes
parser, the responses store of 4) for test_responses.py and test_client_matrix.py,
`pooling_server` (--runner pooling) for test_embeddings.py and test_client_matrix.py. Starting a
server costs seconds; each starts once.

Clients of a test module's own `server` fixture: `http` (httpx with the test API key) and
`client` (the openai client)."""
from __future__ import annotations

import pytest

from tests.server_utils import api_server_args, authed_http, openai_client, served


@pytest.fixture(scope="session")
def api_server(tiny_llama, tmp_path_factory):
    # tests/fault_server.py installed: a test that must watch a request run marks it SLOW_STEPS.
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("api"), api_server_args(
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-responses-api-store",
        "--responses-api-store-size", "4"), module="tests.fault_server")


@pytest.fixture(scope="session")
def pooling_server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("pooling"), api_server_args("--runner", "pooling"))


@pytest.fixture(scope="module")
def http(server):
    with authed_http(server) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)
