from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "Dashboard"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the notification task with Celery in every process that loads Django,
        # workers included (Celery's autodiscovery only imports workers.tasks).
        from workers import notifications  # noqa: F401
