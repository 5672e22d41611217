from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.http import HttpRequest

from .models import ThrottleCounter

# ModelAdmin is generic in django-stubs only; at runtime it takes no type argument.
if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[ThrottleCounter]
else:
    _ModelAdmin = admin.ModelAdmin

@admin.register(ThrottleCounter)
class ThrottleCounterAdmin(_ModelAdmin):
    """Read-only: the extension writes these rows; anyone with view permission reads them.
    Without change permission, the change page shows every field as a read-only view."""

    list_display = ("cap", "acquired", "throttled", "released", "foreign_releases",
                    "released_by_exit", "expired", "adapt_limit", "rate_limited", "flushed_at")
    search_fields = ("cap",)
    ordering = ("cap",)
    fieldsets = (
        (None, {"fields": ["cap", "flushed_at"]}),
        ("Counters", {"fields": ["acquired", "throttled", "released", "foreign_releases",
                                 "released_by_exit", "expired"]}),
        ("Waits and holds", {"fields": ["waits", "wait_timeouts", "wait_time", "hold_time",
                                        "hold_buckets", "wait_buckets"]}),
        ("Adaptive cap", {"fields": ["adapt_min", "adapt_max", "adapt_enforce", "adapt_limit",
                                     "adapt_baseline"]}),
        ("Rate limit", {"fields": ["rate_count", "rate_per", "rate_burst", "rate_limited"]}),
        ("Internals", {"fields": ["lock_key", "flush_id"]}),
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
