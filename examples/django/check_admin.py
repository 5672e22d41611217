"""Looks at the extension's counter rows through Django admin (the stage_e_slots package's app,
stage_e_slots.django), with Django's test client, on a real database that has stage_e_slots
(and, to be worth looking at, flushed counter rows).

It migrates (the unmanaged model's migration must leave the extension's table alone), makes a
superuser, and as that user requests the changelist of stage_e_throttle_counter, its add page,
a row's change page (GET and POST) and its delete page; anonymously, the changelist. It prints
a JSON summary: each status code, the changelist's rows as the page shows them (cap -> column
-> text), the first row's change page's read-only fields (field -> text), the rows as the ORM
reads them, and what sqlmigrate would run for the model.
Usage: check_admin.py HOST PORT DBNAME
"""

import json
import os
import sys
from html.parser import HTMLParser
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the demo project (capdemo, dispatch); stage_e_slots is installed

USERNAME = "admin"
PASSWORD = "stage-e-slots-admin"  # a throwaway database's throwaway superuser


class ChangelistRows(HTMLParser):
    """The rows of the changelist's result table: {cap: {column: text}}, columns by their
    `field-<name>` cell class."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self._in_results = self._in_body = False
        self._field: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id") == "result_list":
            self._in_results = True
        elif self._in_results and tag == "tbody":
            self._in_body = True
        elif self._in_body and tag == "tr":
            self.rows.append({})
        elif self._in_body and tag in ("td", "th"):
            fields = [c[6:] for c in (attrs.get("class") or "").split() if c.startswith("field-")]
            self._field = fields[0] if fields else None
            if self._field:
                self.rows[-1][self._field] = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._field = None
        elif tag == "tbody":
            self._in_body = False
        elif tag == "table":
            self._in_results = False

    def handle_data(self, data):
        if self._field:
            self.rows[-1][self._field] += data

    def by_cap(self):
        return {r["cap"].strip(): {k: v.strip() for k, v in r.items()} for r in self.rows}


class ReadonlyFields(HTMLParser):
    """A change page's read-only fields: {name: text}, by the `field-<name>` class of a form
    row and the text of its `readonly` box."""

    def __init__(self):
        super().__init__()
        self.fields: dict[str, str] = {}
        self._row: str | None = None
        self._depth = 0  # nested divs inside the readonly box

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div" and "form-row" in classes:
            names = [c[6:] for c in classes if c.startswith("field-")]
            self._row = names[0] if names else None
        elif tag == "div" and "readonly" in classes and self._row:
            self.fields[self._row] = ""
            self._depth = 1
        elif tag == "div" and self._depth:
            self._depth += 1

    def handle_endtag(self, tag):
        if tag == "div" and self._depth:
            self._depth -= 1
            if not self._depth:
                self.fields[self._row] = self.fields[self._row].strip()
                self._row = None

    def handle_data(self, data):
        if self._depth and self._row:
            self.fields[self._row] += data


def main():
    host, port, dbname = sys.argv[1:4]
    os.environ.update(DJANGO_SETTINGS_MODULE="capdemo.settings", CAPDEMO_PGHOST=host,
                      CAPDEMO_PGPORT=port, CAPDEMO_PGDATABASE=dbname)
    import django

    django.setup()
    from io import StringIO

    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.urls import reverse
    from stage_e_slots.django.models import ThrottleCounter

    # Fails ("relation already exists") if the migration tried to create the table.
    call_command("migrate", interactive=False, verbosity=0)
    sqlmigrate = StringIO()
    call_command("sqlmigrate", "stage_e_slots", "0001", stdout=sqlmigrate)
    try:
        call_command("makemigrations", "--check", "--dry-run", verbosity=0)
        migrations_match_models = True
    except SystemExit:
        migrations_match_models = False

    setup_test_environment()  # lets the test client's host, testserver, in
    user_model = get_user_model()
    user_model.objects.filter(username=USERNAME).delete()
    user_model.objects.create_superuser(USERNAME, "admin@example.invalid", PASSWORD)

    changelist = reverse("admin:stage_e_slots_throttlecounter_changelist")
    add = reverse("admin:stage_e_slots_throttlecounter_add")
    anonymous = Client().get(changelist)

    client = Client()
    logged_in = client.login(username=USERNAME, password=PASSWORD)
    page = client.get(changelist)
    parser = ChangelistRows()
    parser.feed(page.content.decode())
    orm_rows = {r.cap: {"acquired": r.acquired, "throttled": r.throttled,
                        "released": r.released, "foreign_releases": r.foreign_releases,
                        "released_by_exit": r.released_by_exit, "expired": r.expired,
                        "waits": r.waits, "wait_timeouts": r.wait_timeouts,
                        "hold_time": r.hold_time.total_seconds(),
                        "hold_buckets": r.hold_buckets, "lock_key": r.lock_key,
                        "adapt_min": r.adapt_min, "adapt_max": r.adapt_max,
                        "adapt_enforce": r.adapt_enforce, "adapt_limit": r.adapt_limit,
                        "adapt_baseline": r.adapt_baseline.total_seconds()
                        if r.adapt_baseline is not None else None,
                        "rate_count": r.rate_count, "rate_burst": r.rate_burst,
                        "rate_per": r.rate_per.total_seconds()
                        if r.rate_per is not None else None,
                        "rate_limited": r.rate_limited,
                        "flushed_at": r.flushed_at.isoformat() if r.flushed_at else None}
                for r in ThrottleCounter.objects.all()}
    first = next(iter(orm_rows), None)
    change = reverse("admin:stage_e_slots_throttlecounter_change", args=[first]) if first \
        else None
    delete = reverse("admin:stage_e_slots_throttlecounter_delete", args=[first]) if first \
        else None
    def readonly_fields(client, url):
        fields = ReadonlyFields()
        fields.feed(client.get(url).content.decode())
        return fields.fields

    summary = {
        "logged_in": logged_in,
        "anonymous_status": anonymous.status_code,
        "anonymous_location": anonymous.get("Location"),
        "changelist_status": page.status_code,
        "changelist_rows": parser.by_cap(),
        "orm_rows": orm_rows,
        "add_status": client.get(add).status_code,
        "add_post_status": client.post(add, {"cap": "forged", "acquired": 0, "throttled": 0,
                                             "released": 0, "foreign_releases": 0,
                                             "released_by_exit": 0}).status_code,
        "change_cap": first,
        "change_status": client.get(change).status_code if change else None,
        "change_fields": readonly_fields(client, change) if change else None,
        "change_post_status": client.post(change, {"throttled": 0}).status_code
        if change else None,
        "delete_status": client.get(delete).status_code if delete else None,
        "delete_post_status": client.post(delete, {"post": "yes"}).status_code
        if delete else None,
        "sqlmigrate": sqlmigrate.getvalue(),
        "migrations_match_models": migrations_match_models,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
