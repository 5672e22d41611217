from __future__ import annotations

from django.apps import AppConfig


class StageESlotsConfig(AppConfig):
    """The app of ``"stage_e_slots.django"`` in INSTALLED_APPS (label ``stage_e_slots``)."""

    name = "stage_e_slots.django"
    label = "stage_e_slots"
    verbose_name = "stage_e_slots"

    def ready(self) -> None:
        from django.core import checks

        from .checks import check_settings

        checks.register(check_settings, "stage_e_slots")
