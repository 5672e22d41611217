// What is left for JDBC (README, Limits): setString binds varchar, and PostgreSQL casts varchar
// to interval only explicitly, so a wait bound with setString finds no function. A PGInterval
// built from its fields, setObject(i, "10 s", Types.OTHER), or the connection property
// stringtype=unspecified binds it; new PGInterval("10 s") is zero seconds (PGInterval reads
// "10 secs", not "10 s"), so it silently does not wait. tests/test_drivers.py runs it.
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Types;
import java.util.Properties;
import org.postgresql.util.PGInterval;

public class JdbcVarchar {
    static Connection connect(String stringtype) throws SQLException {
        Properties props = new Properties();
        props.setProperty("user", System.getenv("PGUSER"));
        if (stringtype != null) props.setProperty("stringtype", stringtype);
        return DriverManager.getConnection("jdbc:postgresql://" + System.getenv("PGHOST") + ":"
                + System.getenv("PGPORT") + "/" + System.getenv("PGDATABASE"), props);
    }

    /** stage_e_try_slot(cap, 1[, wait]): the wait bound with setString, or with setObject. */
    static Object slot(Connection c, Object wait) throws SQLException {
        String sql = wait == null ? "SELECT stage_e_try_slot(?, ?)" : "SELECT stage_e_try_slot(?, ?, ?)";
        try (PreparedStatement ps = c.prepareStatement(sql)) {
            ps.setString(1, "exports");
            ps.setInt(2, 1);
            if (wait instanceof String) ps.setString(3, (String) wait);
            else if (wait instanceof Object[]) ps.setObject(3, ((Object[]) wait)[0], Types.OTHER);
            else if (wait != null) ps.setObject(3, wait);
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                return rs.getObject(1);
            }
        }
    }

    public static void main(String[] args) throws Exception {
        try (Connection a = connect(null); Connection b = connect("unspecified")) {
            System.out.println("setString cap, setInt n: " + slot(a, null));
            try {
                slot(a, "50 ms");
                System.out.println("setString wait: resolved");
            } catch (SQLException e) {
                System.out.println("setString wait: " + e.getSQLState());
            }
            System.out.println("stringtype=unspecified, setString wait: " + slot(b, "50 ms"));
            System.out.println("setObject(\"50 ms\", Types.OTHER) wait: "
                    + slot(b, new Object[] {"50 ms"}));
            System.out.println("PGInterval(0, 0, 0, 0, 0, 0.05) wait: "
                    + slot(b, new PGInterval(0, 0, 0, 0, 0, 0.05)));
            System.out.println("PGInterval(\"10 s\") is " + new PGInterval("10 s").getValue());
        }
    }
}
