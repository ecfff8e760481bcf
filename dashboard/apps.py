from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "Dashboard"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from config.env import private_sqlite_files

        # The embedded default's database holds password hashes and sessions: 0600.
        connection_created.connect(private_sqlite_files, dispatch_uid="config.private_sqlite")
