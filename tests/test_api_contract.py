"""Contract tests: property-based requests over every operation of the OpenAPI document,
against a live server, as each role. Whatever is sent: no 5xx, every response conforms to
the document (status, media type, headers, body), and every refused call changes nothing."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.api import api
from durability.models import Approval, Effect
from tests.api_helpers import ROLES, api_for, user_with
from tests.dashboard_helpers import counts, dash_agents, waiting_run

# PostgreSQL only: the tests of each role and operation (test_api*.py) run on the embedded
# default too, and the generated requests reach the same endpoints and engine there.
pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["dash_agents"]

# The generating phase only, valid and invalid input both, a few examples per operation and
# role: the whole module must stay well inside the suite's time budget.
EXAMPLES = 4
CONFIG = SchemathesisConfig.from_dict(
    {
        "phases": {"examples": {"enabled": False}, "coverage": {"enabled": False}},
        "generation": {"mode": "all", "max-examples": EXAMPLES},
    }
)
schema = schemathesis.openapi.from_dict(
    api.get_openapi_schema(path_prefix="/api/v1/"), config=CONFIG
)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture
def world(live_server, role):
    """A run waiting at its approval (with an effect done), and a token for the role under
    test."""
    run = waiting_run("Contract?")
    caller = api_for(live_server, user_with(role, "contract"))
    targets = {
        "run_id": str(run.id),
        "approval_id": Approval.objects.get(run=run).id,
        "effect_id": Effect.objects.get(run=run).id,
    }
    return live_server.url, targets, caller


@pytest.mark.parametrize("role", list(ROLES))
@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_as_every_role(case, world, role):
    url, targets, caller = world
    # Aim at things that exist, so that requests get past "no such run" to the engine.
    for name in targets.keys() & (case.path_parameters or {}).keys():
        case.path_parameters[name] = targets[name]
    before = counts()
    headers = {"Authorization": f"Bearer {caller.secret}"}
    response = case.call(base_url=url, headers=headers)
    case.validate_response(response, checks=CHECKS, headers=headers)
    if response.status_code >= 400:
        assert counts() == before, response.text
