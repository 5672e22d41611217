from django.db.models.signals import post_save
from django.dispatch import receiver
from django_q.tasks import async_task

from .models import Evidence


@receiver(post_save, sender=Evidence)
def enqueue_follow_on(sender, instance, created, **kwargs):
    # The incident's trigger: enqueueing through the ORM broker, outside an atomic block,
    # calls django.db.close_old_connections(), which closes django.db.connection.
    if created:
        async_task("dispatch.tasks.follow_on", instance.pk)
