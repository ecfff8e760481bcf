"""The embedded default's broker writes each message file whole before it can be read."""

from __future__ import annotations

import os

import pytest
from kombu import Connection

from workers import fsbroker

pytestmark = pytest.mark.smoke


def test_a_message_file_appears_only_whole(tmp_path):
    folder = str(tmp_path)
    options = {"data_folder_in": folder, "data_folder_out": folder, "store_processed": False}
    with Connection("filesystem://", transport=fsbroker.Transport, transport_options=options) as c:
        channel = c.default_channel
        assert isinstance(channel, fsbroker.Channel)
        seen: list[list[str]] = []
        real_replace = os.replace

        def replace(src: str, dst: str) -> None:
            # Just before the rename: the only file is the hidden one _get never matches.
            seen.append(sorted(os.listdir(folder)))
            real_replace(src, dst)

        fsbroker.os.replace = replace
        try:
            channel._put("q", {"body": "hello"})
        finally:
            fsbroker.os.replace = real_replace
        assert len(seen[0]) == 1 and seen[0][0].startswith(".incoming-")
        assert [n.endswith(".q.msg") for n in os.listdir(folder)] == [True]
        assert channel._get("q") == {"body": "hello"}
        assert os.listdir(folder) == []
