"""The JSON API, version 1: one NinjaAPI whose OpenAPI 3 document is generated from the
typed endpoints. Errors come back as ``application/problem+json`` (``api.problems``)."""

from __future__ import annotations

from typing import Any

from ninja import NinjaAPI

from api import actions, approvals, checkpoints, observe, problems, runs
from api.auth import TokenAuth

DESCRIPTION = (
    "Drive durable agent runs from scripts, CI and other languages. Every request carries a"
    " personal API token (`Authorization: Bearer <token>`) and acts with its user's role."
    " Errors are `application/problem+json` with the engine's error code."
)


class DurabilityAPI(NinjaAPI):
    def get_openapi_schema(self, **kwargs: Any) -> Any:
        schema = super().get_openapi_schema(**kwargs)
        # Refusals are problem documents: say so, so that clients (and contract tests)
        # expect the media type they will get.
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                for status, reply in operation.get("responses", {}).items():
                    content = reply.get("content", {})
                    if str(status).startswith(("4", "5")) and "application/json" in content:
                        content[problems.MEDIA_TYPE] = content.pop("application/json")
        return schema


api = DurabilityAPI(
    title="Durability API",
    version="1",
    description=DESCRIPTION,
    auth=TokenAuth(),
    parser=problems.JsonBody(),
    urls_namespace="api-v1",
    docs_url="/docs",
    openapi_url="/openapi.json",
)
problems.install(api)
api.add_router("", runs.router)
api.add_router("", checkpoints.router)
api.add_router("", approvals.router)
api.add_router("", actions.router)
api.add_router("", observe.router)
