"""The README's three curl examples (start, list waiting approvals, approve with edits), run
as written with curl against a live server, with a worker's part played by the engine in
this process: the run reaches its approval, the edited decision lands, the run finishes
with it."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from durability.models import Event, Run
from durability.testing import drive
from tests.api_helpers import api_for, user_with
from tests.procs import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


def readme_examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The JSON API") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def run_example(script: str, env: dict[str, str]) -> dict:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.smoke
def test_the_readme_curl_examples_work_as_written(live_server):
    start, inbox, approve = readme_examples()
    api = api_for(live_server, user_with("operator in the policy group", "ops"), "readme")
    env = {"DURABILITY_URL": live_server.url, "DURABILITY_TOKEN": api.secret}

    started = run_example(start, env)
    assert started["agent"] == "support" and started["status"] == "queued", started
    assert run_example(start, env)["id"] == started["id"]  # the key made the retry safe
    waiting = drive(started["id"])
    assert waiting.wait_reason == "approval" and waiting.wait_detail == "refund"

    pending = run_example(inbox, env)["items"]
    card = next(a for a in pending if a["run_id"] == started["id"])
    assert card["name"] == "refund" and card["may_decide"] and card["editable"] == ["amount_eur"]

    env |= {"APPROVAL_ID": str(card["id"]), "RUN_VERSION": str(card["run_version"])}
    decided = run_example(approve, env)
    assert decided["status"] == "approved" and decided["edited_payload"]["amount_eur"] == 120
    event = Event.objects.get(run_id=started["id"], kind="approval_decided")
    assert event.actor == "ops" and "api token 'readme'" in event.data

    done = drive(started["id"])
    assert done.status == "succeeded", done.error
    assert Run.objects.get(pk=started["id"]).status == "succeeded"
    # Sent again on the version it was made on, the decision is refused: nothing twice.
    again = run_example(approve, env)
    assert again["status"] == 409 and again["code"] in ("DUR108", "DUR112")
