package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// ownersFile writes an -engine-owners file of text (mode 0600) and
// returns its path.
func ownersFile(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "owners")
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// -engine-owner (repeatable, several rules a value) and -engine-owners (a
// file, # comments) read into rules in order, users resolved to uids
// (names and numbers), each rule naming where it came from; the
// environment's -engine-owner is replaced by the command line's, as any
// flag's; libkvxfer's JSON configuration takes the same keys. On the old
// code none of these flags existed (parseFlags: "flag provided but not
// defined: -engine-owner").
func TestEngineOwnerFlags(t *testing.T) {
	file := ownersFile(t, "# team rules\n\nteam-a-* root   # alice's team\n  team-b-*\t65534\nsolo 0 #\n")
	c, err := parseFlags([]string{"-engine-owner", "e=x=root lab-*=4242", "-engine-owner", "*=65534", "-engine-owners", file, "-engine-owners-only"})
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.engineOwners()
	if err != nil {
		t.Fatal(err)
	}
	at := func(line int) string { return fmt.Sprintf("-engine-owners %s line %d", file, line) }
	want := []server.EngineOwner{
		{Pattern: "e=x", UID: 0, Rule: "-engine-owner e=x=root"}, // split at the last =
		{Pattern: "lab-*", UID: 4242, Rule: "-engine-owner lab-*=4242"},
		{Pattern: "*", UID: 65534, Rule: "-engine-owner *=65534"},
		{Pattern: "team-a-*", UID: 0, Rule: at(3) + " (team-a-* root)"},
		{Pattern: "team-b-*", UID: 65534, Rule: at(4) + " (team-b-* 65534)"},
		{Pattern: "solo", UID: 0, Rule: at(5) + " (solo 0)"},
	}
	if !slices.Equal(got, want) {
		t.Errorf("engineOwners() =\n%+v\nwant\n%+v", got, want)
	}
	if !c.engineOwnersOnly {
		t.Error("-engine-owners-only not set")
	}

	t.Setenv("KVXFERD_ENGINE_OWNER", "env-*=root env2-*=root")
	c, err = parseFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := c.engineOwners(); len(got) != 2 || got[1].Pattern != "env2-*" {
		t.Errorf("KVXFERD_ENGINE_OWNER's rules: %v, want env-* and env2-*", got)
	}
	c, err = parseFlags([]string{"-engine-owner", "cli-*=root"})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := c.engineOwners(); len(got) != 1 || got[0].Pattern != "cli-*" {
		t.Errorf("KVXFERD_ENGINE_OWNER and -engine-owner: %v, want the command line's only", got)
	}

	c, err = parseJSON([]byte(`{"engine_owner": "a-*=root b-*=65534", "engine-owners-only": true}`))
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := c.engineOwners(); len(got) != 2 || got[1].UID != 65534 || !c.engineOwnersOnly {
		t.Errorf("in-process JSON engine_owner: %v, only %v; want a-* and b-*, only", got, c.engineOwnersOnly)
	}
}

// Bad rules are refused at start, naming the flag (and the file's line)
// and the value: a rule without PATTERN=USER, a user the system does not
// know, uid 4294967295, a pattern with * other than at its end, a pattern
// named twice, a file line without PATTERN USER, a file any other user may
// write or that is missing, -engine-owners-only with no rule. On the old
// code the flags did not exist.
func TestEngineOwnerFlagsRefused(t *testing.T) {
	badLine := ownersFile(t, "ok-* root\nteam-a-* root extra\n")
	unknown := ownersFile(t, "# x\n\nteam-a-* no-such-user-kvxfer\n")
	dup := ownersFile(t, "a-* 65534\n")
	writable := ownersFile(t, "a-* root\n")
	if err := os.Chmod(writable, 0o666); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no user", []string{"-engine-owner", "team-a-*"}, `invalid value "team-a-*" for flag -engine-owner: "team-a-*": want PATTERN=USER`},
		{"empty user", []string{"-engine-owner", "ok=root team-a-*="}, `invalid value "ok=root team-a-*=" for flag -engine-owner: "team-a-*=": want PATTERN=USER`},
		{"empty", []string{"-engine-owner", " "}, `invalid value " " for flag -engine-owner: empty`},
		{"unknown user", []string{"-engine-owner", "a-*=no-such-user-kvxfer"}, `-engine-owner "a-*=no-such-user-kvxfer": user "no-such-user-kvxfer": `},
		{"uid -1", []string{"-engine-owner", "a-*=4294967295"}, `-engine-owner "a-*=4294967295": uid 4294967295: want 0 to 4294967294`},
		{"uid too large", []string{"-engine-owner", "a-*=99999999999"}, `-engine-owner "a-*=99999999999": uid 99999999999: want 0 to 4294967294`},
		{"inner star", []string{"-engine-owner", "a*b=root"}, `-engine-owner a*b=root: pattern "a*b": * may only end a pattern`},
		{"twice", []string{"-engine-owner", "a-*=root", "-engine-owners", dup}, fmt.Sprintf(`-engine-owners %s line 1 (a-* 65534): pattern "a-*" is reserved already (-engine-owner a-*=root)`, dup)},
		{"bad line", []string{"-engine-owners", badLine}, fmt.Sprintf(`-engine-owners %s line 2: "team-a-* root extra": want PATTERN USER`, badLine)},
		{"unknown user in file", []string{"-engine-owners", unknown}, fmt.Sprintf(`-engine-owners %s line 3: "team-a-* no-such-user-kvxfer": user "no-such-user-kvxfer"`, unknown)},
		{"writable file", []string{"-engine-owners", writable}, fmt.Sprintf("-engine-owners %s: mode 0666, writable by group or others", writable)},
		{"missing file", []string{"-engine-owners", "/nonexistent/owners"}, "-engine-owners: open /nonexistent/owners: no such file or directory"},
		{"only without rules", []string{"-engine-owners-only"}, "-engine-owners-only with no -engine-owner or -engine-owners rule"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseFlags(tc.args)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("parseFlags(%q) = %v, want an error with %q", tc.args, err, tc.want)
			}
		})
	}
	t.Run("environment", func(t *testing.T) {
		t.Setenv("KVXFERD_ENGINE_OWNER", "team-a-*")
		if _, err := parseFlags(nil); err == nil || !strings.Contains(err.Error(), `KVXFERD_ENGINE_OWNER="team-a-*": "team-a-*": want PATTERN=USER`) {
			t.Errorf("KVXFERD_ENGINE_OWNER=team-a-*: %v, want an error naming the variable and the value", err)
		}
	})
}

// kvxferd -engine-owner reaches the server: another uid's rank and
// scheduler under a reserved id are refused, naming the id, the flag's
// rule and the uid, and counted in kvxfer_refused_total{reason=
// "engine_reserved"}; the rule's uid's engine attaches; with
// -engine-owners-only an id no rule matches is refused
// (engine_unreserved). On the old code the flags did not exist.
func TestEngineOwnerFlagEnforced(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", runEngineOwnerFlagEnforced)
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runEngineOwnerFlagEnforced(t *testing.T) {
	me, other := os.Getuid(), 65534
	if me == other {
		other = 65533
	}
	dir := t.TempDir()
	metrics := freePort(t)
	c, err := parseFlags([]string{"-socket", filepath.Join(dir, "k.sock"), "-shm-dir", dir, "-peer-listen", "127.0.0.1:0", "-metrics-listen", metrics,
		"-engine-owner", fmt.Sprintf("mine-*=%d theirs-*=%d", me, other), "-engine-owners-only"})
	if err != nil {
		t.Fatal(err)
	}
	startTest(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cc, err := grpc.NewClient("unix://"+c.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	sc := pb.NewSchedulerServiceClient(cc)
	open := func(id string) error {
		_, err := sc.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id, Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}})
		return err
	}
	hello := func(id string) error {
		defer os.Remove(filepath.Join(c.shmDir, "kv")) // connectTinyRank's memory file, once closed
		rs, closeRank, err := connectTinyRank(t, ctx, c.socket, c.shmDir, id)
		defer closeRank()
		if rs != nil {
			go func() {
				for range rs.Finished() {
				}
			}()
			if err := rs.Close(ctx); err != nil {
				t.Errorf("close %s's rank: %v", id, err)
			}
		}
		return err
	}
	for name, call := range map[string]func(string) error{"OpenScheduler": open, "hello": hello} {
		want := fmt.Sprintf(`engine "theirs-1" is reserved for uid %d by the daemon's rule -engine-owner theirs-*=%d`, other, other)
		if err := call("theirs-1"); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), want) {
			t.Errorf("%s(theirs-1) by uid %d: %v, want PermissionDenied with %q", name, me, err, want)
		}
		if err := call("free-1"); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "-engine-owners-only refuses such ids") {
			t.Errorf("%s(free-1) with -engine-owners-only: %v, want PermissionDenied naming -engine-owners-only", name, err)
		}
		if err := call("mine-1"); err != nil {
			t.Errorf("%s(mine-1) by uid %d: %v, want it allowed", name, me, err)
		}
	}
	for reason, want := range map[string]float64{"engine_reserved": 2, "engine_unreserved": 2, "permission": 0} {
		series := fmt.Sprintf(`kvxfer_refused_total{reason="%s"}`, reason)
		if got, _ := value(scrapeAll(t, metrics), series); got != want {
			t.Errorf("%s = %v, want %v", series, got, want)
		}
	}
}

// In process (libkvxfer) the same keys apply through the same code: a
// direct stream's hello and a direct OpenScheduler call (the caller: this
// process's uid) under an id reserved for another uid are refused, naming
// the rule; the process's own ids are served. On the old code the key
// engine_owner was unknown ("key \"engine_owner\": unknown").
func TestEngineOwnerInProcess(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", runEngineOwnerInProcess)
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runEngineOwnerInProcess(t *testing.T) {
	me, other := os.Getuid(), 65534
	if me == other {
		other = 65533
	}
	p, err := StartInProcess(fmt.Appendf(nil, `{"insecure_peers": true, "log_level": "error", "engine_owner": "mine-*=%d theirs-*=%d"}`, me, other))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := p.Stop(); err != nil {
			t.Error(err)
		}
	}()
	want := fmt.Sprintf(`is reserved for uid %d by the daemon's rule -engine-owner theirs-*=%d`, other, other)
	for _, id := range []string{"theirs-1", "mine-1"} {
		req, _ := proto.Marshal(&pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id, Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}})
		_, code, msg := p.CallDirect("OpenScheduler", req, 10*time.Second)
		switch {
		case id == "theirs-1" && (code != codes.PermissionDenied || !strings.Contains(msg, want)):
			t.Errorf("direct OpenScheduler(%s) = %v %q, want PermissionDenied with %q", id, code, msg, want)
		case id == "mine-1" && code != codes.OK:
			t.Errorf("direct OpenScheduler(%s) = %v %q, want it opened", id, code, msg)
		}
	}
	d := p.OpenDirect()
	defer d.Cancel()
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 4}}}
	// Its memory is never looked at: the id is refused first.
	hello, _ := proto.Marshal(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: &pb.WorkerHello{EngineId: "theirs-1", Mode: pb.Mode_MODE_PUSH,
		Layout: stream.LayoutToProto(&l), Memory: []*pb.SharedMemory{{Base: 1 << 20, Size: 1024}}}}})
	if err := d.Put(hello); err != nil {
		t.Fatal(err)
	}
	_, ok, ended, code, msg := d.Take(10 * time.Second)
	if ok || !ended || code != codes.PermissionDenied || !strings.Contains(msg, want) {
		t.Errorf("direct stream's hello under theirs-1: message %v, ended %v, %v %q; want it ended PermissionDenied with %q", ok, ended, code, msg, want)
	}
	if n := p.Refusals()["engine_reserved"]; n != 2 {
		t.Errorf("Refusals()[engine_reserved] = %d, want 2", n)
	}
}
