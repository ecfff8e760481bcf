#!/usr/bin/env python
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from config import telemetry

    # Before Django loads: its instrumentation wraps the middleware it is about to build.
    telemetry.setup("cli", django=True)
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
