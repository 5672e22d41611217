from django.apps import AppConfig


class StageECountersConfig(AppConfig):
    name = "stage_e_counters"
    verbose_name = "stage_e_slots"
