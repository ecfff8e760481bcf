from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Celery workers"

    def ready(self) -> None:
        from durability import dispatch
        from workers import signals  # noqa: F401 - connects the Celery signal handlers
        from workers.dispatcher import publish

        dispatch.set_dispatcher(publish)
