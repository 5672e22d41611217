from django.contrib import admin

from .models import ThrottleCounter


@admin.register(ThrottleCounter)
class ThrottleCounterAdmin(admin.ModelAdmin):
    """Read-only: the extension writes these rows; anyone with view permission reads them."""

    list_display = ["cap", "acquired", "throttled", "released", "foreign_releases",
                    "released_by_exit", "flushed_at"]
    search_fields = ["cap"]
    ordering = ["cap"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
