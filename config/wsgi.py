import os

from django.core.wsgi import get_wsgi_application

from config import telemetry

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
telemetry.setup("web", django=True)
application = get_wsgi_application()
