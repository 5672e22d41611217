"""A minimal Django project replaying the incident: django-q2 with its ORM broker and Django's
default CONN_MAX_AGE = 0, the stage_e_slots package's Django app (pip install
"stage-e-slots[django]") and Django admin showing the extension's counter rows (read-only).
The database comes from the environment (run_incident.py and check_admin.py set it), and so
does the replay's mode (CAPDEMO_MODE: shared, dedicated or lease; run_incident.py sets it)."""

import os

SECRET_KEY = "stage-e-slots-example-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    # Django admin, where the extension's counter rows are shown (stage_e_slots.django).
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_q",
    "dispatch",
    "stage_e_slots.django",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

ROOT_URLCONF = "capdemo.urls"
STATIC_URL = "static/"
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    }
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ["CAPDEMO_PGHOST"],
        "PORT": os.environ["CAPDEMO_PGPORT"],
        "NAME": os.environ["CAPDEMO_PGDATABASE"],
        "USER": "postgres",
        # CONN_MAX_AGE is left at Django's default, 0: a connection is "old" as soon as
        # anything calls close_old_connections(), as django-q2's ORM broker does on enqueue.
    }
}

# Through a transaction pooler (run_incident.py's lease mode points HOST/PORT at a PgBouncer in
# pool_mode = transaction): each transaction may run on another server connection, so no
# server-side prepared statements (Django's default for psycopg 3, said here) and no
# server-side cursors, as Django's documentation asks for transaction pooling.
if os.environ.get("CAPDEMO_POOLER") == "transaction":
    DATABASES["default"]["OPTIONS"] = {"prepare_threshold": None}
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True

# The dedicated mode's slots (stage_e_slots.django.stage_e_slot) are held on a connection of
# their own to DATABASES["default"]'s database: no STAGE_E_SLOTS_DSN is needed for that.
#
# The shared mode replays the bug: its dispatch holds the slot on django.db.connection with raw
# SQL. This setting declares that configuration to stage_e_slots (it would hold session slots
# on that connection), so that `manage.py check` flags it: stage_e_slots.W001, the slot lives
# on a connection Django closes (CONN_MAX_AGE = 0).
if os.environ.get("CAPDEMO_MODE") == "shared":
    STAGE_E_SLOTS_SESSION_CONNECTION = "default"
STAGE_E_CAP = 7
# Lease mode: the cap the leases are taken of (a named cap of its own), and their ttl, far
# longer than a region (about 0.15 s): a lease here ends by its release, never by expiry.
STAGE_E_LEASE_CAP = "dispatch"
STAGE_E_LEASE_TTL = 30

Q_CLUSTER = {
    "name": "capdemo",
    "orm": "default",
    "workers": int(os.environ.get("CAPDEMO_WORKERS", "8")),
    "timeout": 60,
    "retry": 120,
    "max_attempts": 1,
    "poll": 0.05,
    "catch_up": False,
    "save_limit": 0,
}

LOGGING = {
    "version": 1,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"stage_e_slots": {"handlers": ["console"], "level": "WARNING"}},
}
