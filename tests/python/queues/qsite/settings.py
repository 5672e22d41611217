"""A minimal Django project for tests/python/test_task_queues.py: django-q2 on its ORM broker,
Django's default CONN_MAX_AGE = 0 (the incident's stack), PostgreSQL from the environment.

The slots' DSN is not set here unless QSITE_SLOTS_DSN is given: @capped then finds it through
the app "stage_e_slots.django" (conf.dsn(), derived from DATABASES["default"]), as a project
that only lists the app would."""

import os

SECRET_KEY = "stage-e-slots-test-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_q",
    "stage_e_slots.django",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ["QSITE_PGHOST"],
        "PORT": os.environ["QSITE_PGPORT"],
        "NAME": os.environ["QSITE_PGDATABASE"],
        "USER": "postgres",
        # CONN_MAX_AGE left at Django's default, 0: django-q2 closes the connection before every
        # task and in its broker, so a slot held on it would be lost mid-task.
    }
}

if "QSITE_SLOTS_DSN" in os.environ:
    STAGE_E_SLOTS_DSN = os.environ["QSITE_SLOTS_DSN"]

Q_CLUSTER = {
    "name": "qsite",
    "orm": "default",
    "workers": 8,
    "timeout": 60,
    "retry": 300,  # longer than any test: a task is never handed out twice
    "max_attempts": 1,
    "ack_failures": True,
    "poll": 0.05,
    "catch_up": False,
    "save_limit": 0,  # keep every successful task's record (failures are always kept)
}

LOGGING = {
    "version": 1,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"stage_e_slots": {"handlers": ["console"], "level": "WARNING"}},
}
