from django.apps import AppConfig


class ExamplesConfig(AppConfig):
    name = "examples"
    verbose_name = "Demo agents"
    default_auto_field = "django.db.models.BigAutoField"
