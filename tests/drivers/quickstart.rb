# The README's calls from ruby-pg, parameters bound as its users bind them (exec_params with
# Ruby values, sent untyped; results decoded by PG::BasicTypeMapForResults).
# tests/test_drivers.py runs it, reads what it prints and checks the server at each PAUSE.
# Connection from PGHOST, PGPORT, PGDATABASE, PGUSER.
require 'pg'

$stdout.sync = true

def show(v)
  return 'null' if v.nil?
  return v.join(',') if v.is_a?(Array)
  v.to_s
end

def pause(what)
  puts "PAUSE #{what}"
  $stdin.gets
end

def connect(name)
  conn = PG.connect(application_name: name)
  conn.type_map_for_results = PG::BasicTypeMapForResults.new(conn)
  conn.set_notice_processor { |_| } # the WARNING of a refused release is expected
  conn
end

def value(conn, sql, params)
  conn.exec_params(sql, params).getvalue(0, 0)
end

begin
  a = connect('drv-a')
  b = connect('drv-b')

  # Take a slot of a named cap.
  slot = a.exec_params('SELECT stage_e_try_slot($1, $2)', ['exports', 1]).getvalue(0, 0)
  puts "take exports 1: #{show(slot)}"
  pause('holding')
  puts "second connection take exports 1: #{show(value(b, 'SELECT stage_e_try_slot($1, $2)', ['exports', 1]))}"
  puts "second connection wait 50 ms: #{show(value(b, 'SELECT stage_e_try_slot($1, $2, $3)', ['exports', 1, '50 ms']))}"
  # Release it.
  done = a.exec_params('SELECT stage_e_release($1, $2)', ['exports', slot]).getvalue(0, 0)
  puts "release exports #{slot}: #{show(done)}"
  pause('released')
  waited = value(b, 'SELECT stage_e_try_slot($1, $2, $3)', ['exports', 1, '10 s'])
  puts "wait up to 10 s: #{show(waited)}"
  puts "release exports #{waited}: #{show(value(b, 'SELECT stage_e_release($1, $2)', ['exports', waited]))}"

  slots = value(a, 'SELECT stage_e_try_slots($1, $2, $3)', ['batch', 4, 2])
  puts "take 2 of batch 4: #{show(slots)}"
  pause('holding batch')
  puts "release_all batch: #{show(value(a, 'SELECT stage_e_release_all($1)', ['batch']))}"

  # A lease: held by its token, so any connection renews and releases it.
  lease = a.exec_params('SELECT slot, token FROM stage_e_lease($1, $2, $3)', ['jobs', 2, '30 s'])[0]
  puts "lease jobs 2 for 30 s: slot #{show(lease['slot'])} token #{show(lease['token'])}"
  pause('leased')
  puts "renew for 60 s: #{show(value(b, 'SELECT stage_e_renew($1, $2, $3, $4)', ['jobs', lease['slot'], lease['token'], '60 s']))}"
  pause('renewed')
  ['release_lease', 'release_lease again'].each do |what|
    ok = b.exec_params('SELECT stage_e_release_lease($1, $2, $3)', ['jobs', lease['slot'], lease['token']]).getvalue(0, 0)
    puts "#{what}: #{show(ok)}"
  end

  a.exec('SELECT cap, held, acquired, throttled, released, foreign_releases, waits, ' \
         'wait_timeouts, expired FROM stage_e_stats() ORDER BY cap').each_row do |r|
    puts "stats #{r.map { |v| show(v) }.join(' ')}"
  end
  a.close
  b.close
  puts 'done'
rescue PG::Error => e
  puts "ERROR #{e.result&.error_field(PG::PG_DIAG_SQLSTATE)} #{e.message.strip}"
  exit 1
end
