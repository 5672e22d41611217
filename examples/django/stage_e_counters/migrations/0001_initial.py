# The model is unmanaged (managed = False): migrate records this migration but creates,
# alters and drops nothing; stage_e_throttle_counter is the extension's table.

from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
    ]

    operations = [
        migrations.CreateModel(
            name='ThrottleCounter',
            fields=[
                ('cap', models.TextField(primary_key=True, serialize=False)),
                ('acquired', models.BigIntegerField(help_text='Slots handed out.')),
                ('throttled', models.BigIntegerField(help_text='Calls that found every slot taken.')),
                ('released', models.BigIntegerField(help_text='Slots given back (by their holder).')),
                ('foreign_releases', models.BigIntegerField(help_text='Releases by a session that did not hold the slot (the holder kept it).')),
                ('released_by_exit', models.BigIntegerField(help_text='Slots freed because their session ended while holding them.')),
                ('flushed_at', models.DateTimeField(help_text='When the row was last added to.', null=True)),
            ],
            options={
                'verbose_name': 'throttle counter',
                'db_table': 'stage_e_throttle_counter',
                'ordering': ['cap'],
                'managed': False,
            },
        ),
    ]
