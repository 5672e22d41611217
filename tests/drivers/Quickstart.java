// The README's calls from the PostgreSQL JDBC driver, parameters bound as its users bind them:
// setString / setInt / setLong, and an interval as a PGInterval built from its fields (setString
// would send varchar, which PostgreSQL does not cast to interval implicitly; and
// seconds(10) parses to zero: PGInterval reads only words such as "10 secs").
// tests/test_drivers.py runs it (java -cp postgresql.jar Quickstart.java), reads what it prints
// and checks the server at each PAUSE. Connection from PGHOST, PGPORT, PGDATABASE, PGUSER.
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.sql.Array;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.Arrays;
import java.util.Properties;
import java.util.stream.Collectors;
import org.postgresql.util.PGInterval;

public class Quickstart {
    static final BufferedReader STDIN = new BufferedReader(new InputStreamReader(System.in));

    static void pause(String what) throws Exception {
        System.out.println("PAUSE " + what);
        System.out.flush();
        STDIN.readLine();
    }

    /** An interval of this many seconds. */
    static PGInterval seconds(double s) {
        return new PGInterval(0, 0, 0, 0, 0, s);
    }

    static Connection connect(String name) throws SQLException {
        String url = "jdbc:postgresql://" + System.getenv("PGHOST") + ":" + System.getenv("PGPORT")
                + "/" + System.getenv("PGDATABASE");
        Properties props = new Properties();
        props.setProperty("user", System.getenv("PGUSER"));
        props.setProperty("ApplicationName", name);
        return DriverManager.getConnection(url, props);
    }

    static String show(Object v) throws SQLException {
        if (v == null) return "null";
        if (v instanceof Array) {
            return Arrays.stream((Object[]) ((Array) v).getArray()).map(String::valueOf)
                    .collect(Collectors.joining(","));
        }
        return String.valueOf(v);
    }

    /** The first column of the first row, after binding each parameter as JDBC users do. */
    static Object value(Connection c, String sql, Object... params) throws SQLException {
        try (PreparedStatement ps = c.prepareStatement(sql)) {
            for (int i = 0; i < params.length; i++) {
                Object p = params[i];
                if (p instanceof String) ps.setString(i + 1, (String) p);
                else if (p instanceof Integer) ps.setInt(i + 1, (Integer) p);
                else if (p instanceof Long) ps.setLong(i + 1, (Long) p);
                else ps.setObject(i + 1, p);
            }
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                return rs.getObject(1);
            }
        }
    }

    public static void main(String[] args) throws Exception {
        try {
            run();
        } catch (SQLException e) {
            System.out.println("ERROR " + e.getSQLState() + " " + e.getMessage());
            System.exit(1);
        }
    }

    static void run() throws Exception {
        Connection a = connect("drv-a");
        Connection b = connect("drv-b");

        // Take a slot of a named cap.
        PreparedStatement take = a.prepareStatement("SELECT stage_e_try_slot(?, ?)");
        take.setString(1, "exports");
        take.setInt(2, 1);
        ResultSet taken = take.executeQuery();
        taken.next();
        Integer slot = (Integer) taken.getObject(1); // null: throttled
        System.out.println("take exports 1: " + show(slot));
        pause("holding");
        System.out.println("second connection take exports 1: "
                + show(value(b, "SELECT stage_e_try_slot(?, ?)", "exports", 1)));
        System.out.println("second connection wait 50 ms: "
                + show(value(b, "SELECT stage_e_try_slot(?, ?, ?)", "exports", 1, seconds(0.05))));
        // Release it.
        PreparedStatement release = a.prepareStatement("SELECT stage_e_release(?, ?)");
        release.setString(1, "exports");
        release.setInt(2, slot);
        ResultSet released = release.executeQuery();
        released.next();
        System.out.println("release exports " + slot + ": " + released.getBoolean(1));
        pause("released");
        Integer waited = (Integer) value(b, "SELECT stage_e_try_slot(?, ?, ?)", "exports", 1, seconds(10));
        System.out.println("wait up to 10 s: " + show(waited));
        System.out.println("release exports " + waited + ": "
                + show(value(b, "SELECT stage_e_release(?, ?)", "exports", waited)));

        System.out.println("take 2 of batch 4: "
                + show(value(a, "SELECT stage_e_try_slots(?, ?, ?)", "batch", 4, 2)));
        pause("holding batch");
        System.out.println("release_all batch: " + show(value(a, "SELECT stage_e_release_all(?)", "batch")));

        // A lease: held by its token, so any connection renews and releases it.
        PreparedStatement lease = a.prepareStatement("SELECT slot, token FROM stage_e_lease(?, ?, ?)");
        lease.setString(1, "jobs");
        lease.setInt(2, 2);
        lease.setObject(3, new PGInterval(0, 0, 0, 0, 0, 30));
        ResultSet leased = lease.executeQuery();
        leased.next();
        int leaseSlot = leased.getInt("slot");
        long token = leased.getLong("token");
        System.out.println("lease jobs 2 for 30 s: slot " + leaseSlot + " token " + token);
        pause("leased");
        System.out.println("renew for 60 s: " + show(value(b, "SELECT stage_e_renew(?, ?, ?, ?)",
                "jobs", leaseSlot, token, seconds(60))));
        pause("renewed");
        PreparedStatement free = b.prepareStatement("SELECT stage_e_release_lease(?, ?, ?)");
        free.setString(1, "jobs");
        free.setInt(2, leaseSlot);
        free.setLong(3, token);
        for (String what : new String[] {"release_lease", "release_lease again"}) {
            ResultSet freed = free.executeQuery();
            freed.next();
            System.out.println(what + ": " + freed.getBoolean(1));
        }

        try (PreparedStatement ps = a.prepareStatement("SELECT cap, held, acquired, throttled, released, "
                + "foreign_releases, waits, wait_timeouts, expired FROM stage_e_stats() ORDER BY cap");
             ResultSet rs = ps.executeQuery()) {
            while (rs.next()) {
                StringBuilder line = new StringBuilder("stats");
                for (int i = 1; i <= 9; i++) line.append(' ').append(rs.getString(i));
                System.out.println(line);
            }
        }
        a.close();
        b.close();
        System.out.println("done");
    }
}
