"""The JSON API's setting, declared once (see ``durability.conf`` for how a declaration is
read and how the environment is parsed). Declared here, not in the engine, because only the
API reads it."""

from __future__ import annotations

import re

from durability.conf import Declarations, Kind, Setting

_RATE = re.compile(r"[1-9]\d*/[1-9]\d*")


class Rate(Kind[str]):
    """``<requests>/<seconds>``, both positive whole numbers."""

    noun = "<requests>/<seconds>, e.g. 600/60"

    def accept(self, value: object) -> str | None:
        return value if isinstance(value, str) and _RATE.fullmatch(value.strip()) else None

    def parse(self, text: str) -> str | None:
        return self.accept(text.strip())


class Api(Declarations):
    """The API's settings (``DURABILITY_`` + the attribute's name)."""

    API_RATE_LIMIT = Setting(
        Rate(), "600/60", "the JSON API's limit per token: requests per window of seconds"
    )


conf = Api()
