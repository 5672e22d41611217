// The README's calls from pgx (v4, Debian's golang-github-jackc-pgx-v4-dev), parameters bound
// as its users bind them: pgx prepares each statement, the server infers the parameter types,
// and pgx encodes Go values for them (an interval from a time.Duration).
// tests/test_drivers.py runs it, reads what it prints and checks the server at each PAUSE.
// Connection from PGHOST, PGPORT, PGDATABASE, PGUSER.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
)

var ctx = context.Background()
var stdin = bufio.NewReader(os.Stdin)

func pause(what string) {
	fmt.Printf("PAUSE %s\n", what)
	stdin.ReadString('\n')
}

func show(v interface{}) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case *int32:
		if x == nil {
			return "null"
		}
		return fmt.Sprint(*x)
	case []int32:
		s := make([]string, len(x))
		for i, n := range x {
			s[i] = fmt.Sprint(n)
		}
		return strings.Join(s, ",")
	}
	return fmt.Sprint(v)
}

func connect(name string) *pgx.Conn {
	config, err := pgx.ParseConfig("")
	check(err)
	config.RuntimeParams["application_name"] = name
	conn, err := pgx.ConnectConfig(ctx, config)
	check(err)
	return conn
}

func check(err error) {
	if err == nil {
		return
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		fmt.Printf("ERROR %s %s\n", pgErr.Code, pgErr.Message)
	} else {
		fmt.Printf("ERROR - %s\n", err)
	}
	os.Exit(1)
}

func main() {
	a := connect("drv-a")
	b := connect("drv-b")
	var slot, got, waited *int32
	var ok bool

	// Take a slot of a named cap.
	check(a.QueryRow(ctx, "SELECT stage_e_try_slot($1, $2)", "exports", 1).Scan(&slot))
	fmt.Printf("take exports 1: %s\n", show(slot))
	pause("holding")
	check(b.QueryRow(ctx, "SELECT stage_e_try_slot($1, $2)", "exports", 1).Scan(&got))
	fmt.Printf("second connection take exports 1: %s\n", show(got))
	check(b.QueryRow(ctx, "SELECT stage_e_try_slot($1, $2, $3)", "exports", 1, 50*time.Millisecond).Scan(&got))
	fmt.Printf("second connection wait 50 ms: %s\n", show(got))
	// Release it.
	check(a.QueryRow(ctx, "SELECT stage_e_release($1, $2)", "exports", *slot).Scan(&ok))
	fmt.Printf("release exports %d: %v\n", *slot, ok)
	pause("released")
	check(b.QueryRow(ctx, "SELECT stage_e_try_slot($1, $2, $3)", "exports", 1, 10*time.Second).Scan(&waited))
	fmt.Printf("wait up to 10 s: %s\n", show(waited))
	check(b.QueryRow(ctx, "SELECT stage_e_release($1, $2)", "exports", *waited).Scan(&ok))
	fmt.Printf("release exports %d: %v\n", *waited, ok)

	var slots []int32
	check(a.QueryRow(ctx, "SELECT stage_e_try_slots($1, $2, $3)", "batch", 4, 2).Scan(&slots))
	fmt.Printf("take 2 of batch 4: %s\n", show(slots))
	pause("holding batch")
	var released int32
	check(a.QueryRow(ctx, "SELECT stage_e_release_all($1)", "batch").Scan(&released))
	fmt.Printf("release_all batch: %d\n", released)

	// A lease: held by its token, so any connection renews and releases it.
	var leaseSlot int32
	var token int64
	check(a.QueryRow(ctx, "SELECT slot, token FROM stage_e_lease($1, $2, $3)", "jobs", 2, 30*time.Second).Scan(&leaseSlot, &token))
	fmt.Printf("lease jobs 2 for 30 s: slot %d token %d\n", leaseSlot, token)
	pause("leased")
	check(b.QueryRow(ctx, "SELECT stage_e_renew($1, $2, $3, $4)", "jobs", leaseSlot, token, 60*time.Second).Scan(&ok))
	fmt.Printf("renew for 60 s: %v\n", ok)
	pause("renewed")
	for _, what := range []string{"release_lease", "release_lease again"} {
		check(b.QueryRow(ctx, "SELECT stage_e_release_lease($1, $2, $3)", "jobs", leaseSlot, token).Scan(&ok))
		fmt.Printf("%s: %v\n", what, ok)
	}

	rows, err := a.Query(ctx, "SELECT cap, held, acquired, throttled, released, foreign_releases, "+
		"waits, wait_timeouts, expired FROM stage_e_stats() ORDER BY cap")
	check(err)
	for rows.Next() {
		var cap string
		var held int32
		var n [7]int64
		check(rows.Scan(&cap, &held, &n[0], &n[1], &n[2], &n[3], &n[4], &n[5], &n[6]))
		fmt.Printf("stats %s %d %d %d %d %d %d %d %d\n", cap, held, n[0], n[1], n[2], n[3], n[4], n[5], n[6])
	}
	check(rows.Err())
	a.Close(ctx)
	b.Close(ctx)
	fmt.Println("done")
}
