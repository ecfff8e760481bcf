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
from durability.models import Approval, Message
from tests.api_helpers import api_for, user_with
from tests.dashboard_helpers import counts, dash_agents, waiting_run

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["dash_agents"]

# The generating phase only, valid and invalid input both, a few examples per operation and
# role: the whole module must stay well inside the suite's time budget.
CONFIG = SchemathesisConfig.from_dict(
    {
        "phases": {"examples": {"enabled": False}, "coverage": {"enabled": False}},
        "generation": {"mode": "all", "max-examples": 5},
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
ROLES = ["no role", "viewer", "operator in the policy group"]


@pytest.fixture
def world(live_server):
    """A run waiting at its approval, and a token per role."""
    run = waiting_run("Contract?")
    tokens = {
        role: api_for(live_server, user_with(role, f"user{i}")) for i, role in enumerate(ROLES)
    }
    return live_server.url, run, Approval.objects.get(run=run), tokens


@pytest.mark.parametrize("role", ROLES)
@schema.parametrize()
@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_as_every_role(case, world, role):
    url, run, approval, tokens = world
    # Aim at things that exist, so that requests get past "no such run" to the engine.
    if "run_id" in case.path_parameters:
        case.path_parameters["run_id"] = str(run.id)
    if "approval_id" in case.path_parameters:
        case.path_parameters["approval_id"] = approval.id
    before = counts() | {"messages": Message.objects.count()}
    headers = {"Authorization": f"Bearer {tokens[role].secret}"}
    response = case.call(base_url=url, headers=headers)
    case.validate_response(response, checks=CHECKS, headers=headers)
    if response.status_code >= 400:
        assert counts() | {"messages": Message.objects.count()} == before, response.text
