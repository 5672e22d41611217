from django.apps import AppConfig


class DispatchConfig(AppConfig):
    name = "dispatch"

    def ready(self):
        from . import signals  # noqa: F401 - connects the post_save receiver
