// The README's calls from node-postgres, parameters bound as its users bind them (sent untyped).
// tests/test_drivers.py runs it, reads what it prints and checks the server at each PAUSE.
// Connection from PGHOST, PGPORT, PGDATABASE, PGUSER.
const { Client } = require('pg');
const readline = require('readline');

const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
async function pause(what) {
  console.log(`PAUSE ${what}`);
  await lines.next();
}
const show = (v) => (v === null ? 'null' : Array.isArray(v) ? v.join(',') : String(v));
const value = async (c, text, params) => Object.values((await c.query(text, params)).rows[0])[0];

async function main() {
  const a = new Client({ application_name: 'drv-a' });
  const b = new Client({ application_name: 'drv-b' });
  await a.connect();
  await b.connect();

  // Take a slot of a named cap.
  const slot = (await a.query('SELECT stage_e_try_slot($1, $2)', ['exports', 1])).rows[0].stage_e_try_slot;
  console.log(`take exports 1: ${show(slot)}`);
  await pause('holding');
  console.log(`second connection take exports 1: ${show(await value(b, 'SELECT stage_e_try_slot($1, $2)', ['exports', 1]))}`);
  console.log(`second connection wait 50 ms: ${show(await value(b, 'SELECT stage_e_try_slot($1, $2, $3)', ['exports', 1, '50 ms']))}`);
  // Release it.
  const released = (await a.query('SELECT stage_e_release($1, $2)', ['exports', slot])).rows[0].stage_e_release;
  console.log(`release exports ${slot}: ${show(released)}`);
  await pause('released');
  const waited = await value(b, 'SELECT stage_e_try_slot($1, $2, $3)', ['exports', 1, '10 s']);
  console.log(`wait up to 10 s: ${show(waited)}`);
  console.log(`release exports ${waited}: ${show(await value(b, 'SELECT stage_e_release($1, $2)', ['exports', waited]))}`);

  const slots = await value(a, 'SELECT stage_e_try_slots($1, $2, $3)', ['batch', 4, 2]);
  console.log(`take 2 of batch 4: ${show(slots)}`);
  await pause('holding batch');
  console.log(`release_all batch: ${show(await value(a, 'SELECT stage_e_release_all($1)', ['batch']))}`);

  // A lease: held by its token, so any connection renews and releases it.
  const lease = (await a.query('SELECT slot, token FROM stage_e_lease($1, $2, $3)', ['jobs', 2, '30 s'])).rows[0];
  console.log(`lease jobs 2 for 30 s: slot ${show(lease.slot)} token ${show(lease.token)}`);
  await pause('leased');
  console.log(`renew for 60 s: ${show(await value(b, 'SELECT stage_e_renew($1, $2, $3, $4)', ['jobs', lease.slot, lease.token, '60 s']))}`);
  await pause('renewed');
  for (const what of ['release_lease', 'release_lease again']) {
    const freed = (await b.query('SELECT stage_e_release_lease($1, $2, $3)', ['jobs', lease.slot, lease.token])).rows[0].stage_e_release_lease;
    console.log(`${what}: ${show(freed)}`);
  }

  const stats = await a.query(
    'SELECT cap, held, acquired, throttled, released, foreign_releases, waits, wait_timeouts, expired ' +
    'FROM stage_e_stats() ORDER BY cap');
  for (const r of stats.rows) {
    console.log(`stats ${Object.values(r).map(show).join(' ')}`);
  }
  await a.end();
  await b.end();
  console.log('done');
  lines.return();
  process.stdin.destroy();
}

main().catch((e) => {
  console.log(`ERROR ${e.code} ${e.message}`);
  process.exit(1);
});
