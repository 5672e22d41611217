"""A minimal Django project replaying the incident: django-q2 with its ORM broker and Django's
default CONN_MAX_AGE = 0, and Django admin showing the extension's counter rows (read-only).
The database comes from the environment (run_incident.py and check_admin.py set it)."""

import os
import sys
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
# The dedicated-connection helper lives in examples/python.
sys.path.insert(0, str(BASE_DIR.parent / "python"))

SECRET_KEY = "stage-e-slots-example-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    # Django admin, where the extension's counter rows are shown (stage_e_counters).
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_q",
    "dispatch",
    "stage_e_counters",
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

# The DSN the dedicated-connection helper uses: the same database, its own connection.
STAGE_E_DSN = (f"host={os.environ['CAPDEMO_PGHOST']} port={os.environ['CAPDEMO_PGPORT']} "
               f"dbname={os.environ['CAPDEMO_PGDATABASE']} user=postgres")
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
    "loggers": {"stage_e_slot": {"handlers": ["console"], "level": "WARNING"}},
}
