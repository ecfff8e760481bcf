"""Kombu's filesystem transport with atomic message files: the embedded default's broker.

Kombu's own ``_put`` creates the message file under its final name and only then writes
into it (under an flock that a reader's rename ignores), so a worker polling the folder
can take the file while it is still empty; the JSON decode then fails inside the worker's
consumer loop and the worker stops consuming. Seen here: a smoke test's worker stalled
for its whole 90 s. This one writes to a hidden temporary file in the same folder (which
``_get`` never picks: it matches ``<stamp>_<uuid>.<queue>.msg``) and renames it into place.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        folder = self.data_folder_out
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".incoming-")
        except OSError as exc:
            raise ChannelError(f"Cannot add a file to directory {folder!r}") from exc
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(tmp, os.path.join(folder, name))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise ChannelError(f"Cannot add file {name!r} to directory {folder!r}") from exc


class Transport(filesystem.Transport):
    Channel = Channel
