"""schemathesis against the control plane's own OpenAPI schema, on a real uvicorn on loopback: generated
requests (valid and invalid) to every operation never get a 5xx, and every answer's status, content type,
headers and body match what the schema documents. Runs with and without an admin token."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")  # the server extra; schemathesis (test extra) alone is not enough
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.config import (  # noqa: E402
    ChecksConfig,
    CoveragePhaseConfig,
    GenerationConfig,
    PhasesConfig,
    ProjectConfig,
    ProjectsConfig,
    SchemathesisConfig,
)
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from orbitkv_fs.manager import Manager, ManagerConfig  # noqa: E402
from orbitkv_fs.pages import host_engine_pages  # noqa: E402
from orbitkv_fs.server.app import HttpServer, create_app  # noqa: E402
from orbitkv_fs.server.auth import AdminToken  # noqa: E402
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier  # noqa: E402

TOKEN = "schemathesis-admin-token-0123456789"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module", params=["open", "token"])
def served(request, tmp_path_factory):
    token = TOKEN if request.param == "token" else None
    tmp = tmp_path_factory.mktemp("ssd")
    manager = Manager(ManagerConfig(pool_size=4 << 20, shm_dir=SHM, device="cpu"),
                      lower_tier=SsdTier(SsdConfig(paths=(str(tmp / "ssd0"),), capacity=8 << 20)))
    # One real engine, so that generated ids sometimes hit (and DELETE may remove it: also fine).
    pages, descs = host_engine_pages(num_layers=2, num_blocks=8, block_size=4, num_heads=1, head_dim=32,
                                     directory=SHM)
    from orbitkv_fs.manager import EngineRegistration

    manager.register_engine(EngineRegistration(model="m", num_layers=2, layer_start=0, layer_end=2, block_size=4,
                                               num_heads=1, head_dim=32, dtype="bfloat16", tensors=descs,
                                               engine_id="e0"))
    server = HttpServer(create_app(manager, admin_token=AdminToken(token) if token else None), "127.0.0.1", 0).start()
    yield server.url, token
    server.close()
    manager.close()
    pages.close()


@pytest.fixture(scope="module")
def api_schema(served):
    url, token = served
    # The coverage phase (boundary and negative values of every field) is the slow one: it runs once, on
    # the open app; with a token the fuzzing phase checks that auth keeps the answers conformant.
    phases = PhasesConfig(coverage=CoveragePhaseConfig(enabled=token is None))
    # The token goes in every request (below); schemathesis must not also generate (negative) auth headers
    # it would then count as "schema-violating requests accepted".
    generation = GenerationConfig(with_security_parameters=False)
    # A body over the app's limit (4 MiB) is refused with 413 before it is parsed: that is how a registration of
    # more tensors than its schema's maxItems, generated as negative data, is rejected (CI met one of 5.5 MB).
    # The library's own defaults, plus 413, through its public classes (the defaults' module is private).
    default = ChecksConfig().negative_data_rejection
    checks = ChecksConfig(negative_data_rejection=type(default)(expected_statuses=[*default.expected_statuses, "413"]))
    config = SchemathesisConfig(projects=ProjectsConfig(default=ProjectConfig(phases=phases, generation=generation,
                                                                              checks=checks)))
    return schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_conformance(case, served):
    url, token = served
    headers = {"Authorization": f"Bearer {token}"} if token else None
    case.call_and_validate(base_url=url, headers=headers, checks=CHECKS)
