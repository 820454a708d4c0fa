package server_test

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// otherUID is a uid that is not this process's.
func otherUID() uint32 {
	if os.Getuid() == 65534 {
		return 65533
	}
	return 65534
}

// openSched opens engine id's scheduler over c.
func openSched(ctx context.Context, c pb.SchedulerServiceClient, id string) error {
	_, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id, Mode: pb.Mode_MODE_PUSH,
		TpSize: 1, LogicalBlockSize: 16}})
	return err
}

// smallEngine is attachSmall's engine: one rank, one full-attention layer
// of 2 heads of 8, 8 blocks of 16 tokens.
func smallEngine() (kvsim.Model, kvsim.Engine) {
	return kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2},
		kvsim.Engine{ID: 1, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}
}

// helloSmall attaches a one-rank engine id (attachSmall's) and returns
// Connect's error; an attached engine is closed when the test ends.
func helloSmall(t *testing.T, d *daemon, shmDir, id string) error {
	t.Helper()
	model, eng := smallEngine()
	e, err := tryAttach(t, d, shmDir, id, &model, eng, kvxfer.ModePush)
	if err == nil {
		t.Cleanup(func() { e.close(t) })
	}
	return err
}

// Engine ids the daemon's rules reserve (Config.EngineOwners, kvxferd
// -engine-owner) are refused to every other uid, on a rank's hello and on
// OpenScheduler alike, PermissionDenied naming the id, the rule and the
// uid it is reserved for, counted as engine_reserved; the rule's uid gets
// them. An id several rules match belongs to the most specific (an exact
// id over any prefix, the longest prefix over shorter ones); ids no rule
// matches stay first come, first served. On the old code there were no
// rules: an id was any uid's that asked first.
func TestEngineOwnersReserveIDs(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", runEngineOwnersReserveIDs)
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runEngineOwnersReserveIDs(t *testing.T) {
	me, other := uint32(os.Getuid()), otherUID()
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) {
		c.EngineOwners = []server.EngineOwner{
			{Pattern: "mine-*", UID: me},
			{Pattern: "theirs-*", UID: other, Rule: `-engine-owner "theirs-*=nobody"`},
			{Pattern: "mine-but-theirs", UID: other}, // exact over the prefix mine-*
			{Pattern: "team-*", UID: other},
			{Pattern: "team-a-*", UID: me}, // longest prefix over team-*
			{Pattern: "team-a-b-*", UID: other},
		}
	})
	_, sc, ctx := schedulerClientOn(t, d)
	for _, tc := range []struct {
		name, id string
		rule     string // refused, naming this rule ("" allowed)
	}{
		{"prefix of mine", "mine-1", ""},
		{"prefix of another uid", "theirs-1", `-engine-owner "theirs-*=nobody"`},
		{"exact id of another uid over a prefix of mine", "mine-but-theirs", fmt.Sprintf("mine-but-theirs=%d", other)},
		{"longest prefix mine", "team-a-1", ""},
		{"shorter prefix another uid's", "team-b-1", fmt.Sprintf("team-*=%d", other)},
		{"longest prefix another uid's", "team-a-b-1", fmt.Sprintf("team-a-b-*=%d", other)},
		{"no rule: first come, first served", "free-1", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, call := range []struct {
				what string
				do   func() error
			}{
				{"OpenScheduler", func() error { return openSched(ctx, sc, tc.id) }},
				{"hello", func() error { return helloSmall(t, d, shmDir, tc.id) }},
			} {
				reserved := d.srv.Refusals()["engine_reserved"]
				permission := d.srv.Refusals()["permission"]
				err := call.do()
				if tc.rule == "" {
					if err != nil {
						t.Errorf("%s(%s) by uid %d = %v, want it allowed", call.what, tc.id, me, err)
					}
					continue
				}
				want := fmt.Sprintf("engine %q is reserved for uid %d by the daemon's rule %s", tc.id, other, tc.rule)
				if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), fmt.Sprintf("uid %d may not", me)) {
					t.Errorf("%s(%s) by uid %d = %v, want PermissionDenied with %q", call.what, tc.id, me, err, want)
				}
				if got := d.srv.Refusals()["engine_reserved"]; got != reserved+1 {
					t.Errorf("%s(%s): Refusals()[engine_reserved] = %d, want %d", call.what, tc.id, got, reserved+1)
				}
				if got := d.srv.Refusals()["permission"]; got != permission {
					t.Errorf("%s(%s): Refusals()[permission] = %d, want %d (counted as engine_reserved only)", call.what, tc.id, got, permission)
				}
			}
		})
	}
	if err := openSched(ctx, sc, ""); status.Code(err) != codes.InvalidArgument {
		t.Errorf("OpenScheduler of an empty id = %v, want InvalidArgument (bad input, whatever the rules)", err)
	}
}

// With Config.EngineOwnersOnly (kvxferd -engine-owners-only) an id no rule
// matches is refused too, counted as engine_unreserved, the refusal
// telling the engine which patterns its uid has; reserved ids are their
// uid's as without it. On the old code every unreserved id was free.
func TestEngineOwnersOnly(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", runEngineOwnersOnly)
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runEngineOwnersOnly(t *testing.T) {
	me, other := uint32(os.Getuid()), otherUID()
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) {
		c.EngineOwners = []server.EngineOwner{{Pattern: "mine-*", UID: me}, {Pattern: "solo", UID: me}, {Pattern: "theirs-*", UID: other}}
		c.EngineOwnersOnly = true
	})
	_, sc, ctx := schedulerClientOn(t, d)
	calls := []struct {
		what string
		do   func(id string) error
	}{
		{"OpenScheduler", func(id string) error { return openSched(ctx, sc, id) }},
		{"hello", func(id string) error { return helloSmall(t, d, shmDir, id) }},
	}
	for _, call := range calls {
		for _, id := range []string{"mine-1", "solo"} {
			if err := call.do(id); err != nil {
				t.Errorf("%s(%s) by its rule's uid = %v, want it allowed", call.what, id, err)
			}
		}
		n := d.srv.Refusals()["engine_unreserved"]
		err := call.do("free-1")
		want := fmt.Sprintf(`engine "free-1" matches no rule of the daemon's, and kvxferd -engine-owners-only refuses such ids (uid %d may use ids of its own rules only: mine-* solo)`, me)
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), want) {
			t.Errorf("%s(free-1) under EngineOwnersOnly = %v, want PermissionDenied with %q", call.what, err, want)
		}
		if got := d.srv.Refusals()["engine_unreserved"]; got != n+1 {
			t.Errorf("%s(free-1): Refusals()[engine_unreserved] = %d, want %d", call.what, got, n+1)
		}
		if err := call.do("theirs-1"); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "reserved for uid") {
			t.Errorf("%s(theirs-1) = %v, want PermissionDenied: reserved for another uid", call.what, err)
		}
	}
}

// Rules that could not mean what they say are refused when the server is
// made, naming the rule: an empty pattern, a * anywhere but at the end, a
// pattern longer than any engine id, a pattern named twice, uid
// 4294967295 ((uid_t)-1, no process's), and EngineOwnersOnly with no rule
// (every id refused).
func TestEngineOwnersConfigRefused(t *testing.T) {
	long := strings.Repeat("x", server.MaxEngineID+1)
	for _, tc := range []struct {
		name  string
		rules []server.EngineOwner
		only  bool
		want  string
	}{
		{"empty pattern", []server.EngineOwner{{Pattern: "", UID: 1, Rule: "-engine-owner =alice"}}, false, "-engine-owner =alice: the pattern is empty"},
		{"inner star", []server.EngineOwner{{Pattern: "a*b", UID: 1}}, false, `server: Config.EngineOwners[0] (a*b=1): pattern "a*b": * may only end a pattern`},
		{"two stars", []server.EngineOwner{{Pattern: "a**", UID: 1}}, false, `pattern "a**": * may only end a pattern`},
		{"too long", []server.EngineOwner{{Pattern: long, UID: 1}}, false, fmt.Sprintf("%d bytes of engine id, want at most %d", len(long), server.MaxEngineID)},
		{"twice", []server.EngineOwner{{Pattern: "a-*", UID: 1, Rule: "first"}, {Pattern: "a-*", UID: 2, Rule: "second"}}, false,
			`second: pattern "a-*" is reserved already (first)`},
		{"no user's uid", []server.EngineOwner{{Pattern: "a", UID: math.MaxUint32}}, false, "uid 4294967295 is no user's"},
		{"only without rules", nil, true, "EngineOwnersOnly with no Config.EngineOwners"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := server.New(server.Config{PeerAddr: "127.0.0.1:1", Logger: quiet, EngineOwners: tc.rules, EngineOwnersOnly: tc.only})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New(EngineOwners %v, only %v) = %v, want an error with %q", tc.rules, tc.only, err, tc.want)
			}
			if err := server.CheckEngineOwners(tc.rules); !tc.only && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Errorf("CheckEngineOwners(%v) = %v, want an error with %q", tc.rules, err, tc.want)
			}
		})
	}
}

// ownersEngine is the child process of TestReservedIDRefusedToAnotherUser,
// run as another uid: for each "op:id" of arg ("open" its scheduler,
// "hello" a rank), it prints the answer.
func ownersEngine(sock, arg string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	defer cc.Close()
	c, err := stream.Dial("unix://" + sock)
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	defer c.Close()
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 4}}}
	for _, item := range strings.Fields(arg) {
		op, id, _ := strings.Cut(item, ":")
		switch op {
		case "open":
			err = openSched(ctx, pb.NewSchedulerServiceClient(cc), id)
		case "hello":
			// Memory it could not map: an id reserved for another uid is
			// refused before any of it is looked at.
			var rs *stream.RankStream
			rs, err = c.Connect(ctx, stream.Hello{EngineID: id, Mode: kvxfer.ModePush, Layout: l, CompatHash: "m",
				Memory: []stream.Memory{{Path: "/nonexistent/kv", Base: 1 << 20, Size: 1024}}})
			if rs != nil {
				_ = rs.Close(ctx)
			}
		}
		fmt.Printf("%s %s: %v\n", op, id, err)
	}
	return 0
}

// A user's engine ids reserved for it (Config.EngineOwners) cannot be
// taken by another local user: before the owner's engine starts, the
// other uid's scheduler and rank under such an id are refused (on the old
// code the other uid's scheduler took the id, and the owner's engine was
// then refused as long as the other one's ran:
// TestSquattedEngineIDFreedWithTheSquatter); once the owner's engine
// holds it, another uid's tries are refused the same way
// (engine_reserved), and the owner's scheduler and rank carry on
// undisturbed. Ids no rule matches stay open to every uid. Needs root, to
// run the other user's engine as uid 65534 (setpriv).
func TestReservedIDRefusedToAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running an engine as another user needs root (setpriv); CI runs as root")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv (util-linux) is needed to run as another user: %v", err)
	}
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runReservedIDRefusedToAnotherUser(t, setpriv) })
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runReservedIDRefusedToAnotherUser(t *testing.T, setpriv string) {
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) {
		c.EngineOwners = []server.EngineOwner{{Pattern: "victim-*", UID: 0, Rule: "-engine-owner victim-*=root"}}
	})
	// Let uid 65534 reach the socket.
	for _, p := range []string{filepath.Dir(filepath.Dir(d.sock)), filepath.Dir(d.sock)} {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(d.sock, 0o666); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	other := func(ops string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", self, "-test.run=^$")
		cmd.Env = append(os.Environ(), "KVXFER_OWNERS_ENGINE="+d.sock+"|"+ops)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("uid 65534's engine: %v\n%s", err, out)
		}
		return string(out)
	}
	refused := func(out string, ops ...string) {
		t.Helper()
		for _, op := range ops {
			want := op + `: rpc error: code = PermissionDenied desc = permission denied: engine "victim-1" is reserved for uid 0 by the daemon's rule -engine-owner victim-*=root`
			if !strings.Contains(out, want) {
				t.Errorf("uid 65534's %s: want %q; it said:\n%s", op, want, out)
			}
		}
	}
	// Before the owner's engine starts.
	out := other("open:victim-1 hello:victim-1 open:free-1")
	refused(out, "open victim-1", "hello victim-1")
	if !strings.Contains(out, "open free-1: <nil>") {
		t.Errorf("uid 65534's scheduler under an id no rule matches: want it opened; it said:\n%s", out)
	}
	if n := d.srv.Refusals()["engine_reserved"]; n != 2 {
		t.Errorf("Refusals()[engine_reserved] = %d, want 2", n)
	}
	// The owner's engine: its scheduler and a rank.
	_, sc, ctx := schedulerClientOn(t, d)
	if err := openSched(ctx, sc, "victim-1"); err != nil {
		t.Fatalf("the owner's scheduler: %v", err)
	}
	model, eng := smallEngine()
	e, err := tryAttach(t, d, shmDir, "victim-1", &model, eng, kvxfer.ModePush)
	if err != nil {
		t.Fatalf("the owner's rank: %v", err)
	}
	defer e.close(t)
	// Another uid's tries while it runs.
	refused(other("open:victim-1 hello:victim-1"), "open victim-1", "hello victim-1")
	if n := d.srv.Refusals()["engine_reserved"]; n != 4 {
		t.Errorf("Refusals()[engine_reserved] = %d, want 4", n)
	}
	// Undisturbed: the owner's scheduler answers, its rank steps.
	if _, err := sc.Step(ctx, &pb.StepRequest{EngineId: "victim-1", PublishStep: 1}); err != nil {
		t.Errorf("the owner's scheduler after another uid's tries: %v", err)
	}
	e.step(t, &kvxfer.StepMeta{})
	if _, err := d.srv.Handshake(ctx, &pb.HandshakeRequest{EngineId: "victim-1"}); err != nil {
		t.Errorf("a handshake with the owner's engine after another uid's tries: %v, want its rank", err)
	}
}
