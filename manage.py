#!/usr/bin/env python
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from config import settings_check, telemetry

    # The settings first, a bad environment refused in one line (exit 2) naming what to set.
    settings_check.load_or_exit()
    # Before Django loads: its instrumentation wraps the middleware it is about to build.
    telemetry.setup("cli", django=True)
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
