import os

from django.core.wsgi import get_wsgi_application

from config import settings_check, telemetry

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
# Refused here, the web process does not start (gunicorn: "Worker failed to boot") and its
# log says why (``settings_check``).
settings_check.load()
telemetry.setup("web", django=True)
application = get_wsgi_application()
