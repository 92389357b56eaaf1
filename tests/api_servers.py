"""Live servers on the tiny model shared by the API-surface tests (session-scoped, registered in
conftest.py): `api_server` (auto tool choice with the hermes parser, the responses store of 4)
for test_responses.py and test_client_matrix.py, `pooling_server` (--runner pooling) for
test_embeddings.py and test_client_matrix.py. Starting a server costs seconds; each starts once."""
from __future__ import annotations

import pytest

from pagedserve.server.launcher import launch_server
from tests.server_utils import API_KEY, tiny_server_args


@pytest.fixture(scope="session")
def api_server(tiny_llama, tmp_path_factory):
    srv = launch_server(tiny_llama.path, tiny_server_args(
        "--api-key", API_KEY, "--served-model-name", "tiny", "--shutdown-timeout", "0",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-responses-api-store",
        "--responses-api-store-size", "4"), tmp_path_factory.mktemp("api") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="session")
def pooling_server(tiny_llama, tmp_path_factory):
    srv = launch_server(tiny_llama.path, tiny_server_args("--api-key", API_KEY, "--served-model-name", "tiny",
                                                          "--shutdown-timeout", "0", "--runner", "pooling"),
                        tmp_path_factory.mktemp("pooling") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
