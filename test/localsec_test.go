package test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// floodStreams is how many calls the stream-flood attack keeps open over
// one connection: past kvxferd's default bound on one user's calls in
// flight (-max-calls-per-uid 2048).
const floodStreams = 3000

func init() {
	// Keep floodStreams calls open over one connection to the engine
	// socket (health watches: each lives until the caller ends it), then
	// say how many the daemon took and how the others were refused.
	attacks["stream-flood"] = func(ctx context.Context, p func(string, error)) {
		cc, err := grpc.NewClient("unix://"+os.Getenv("KVXFER_SOCK"), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			p("dial", err)
			return
		}
		defer cc.Close()
		hc := healthpb.NewHealthClient(cc)
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		admitted, refused := 0, 0
		var first error
		for range floodStreams {
			w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{})
			if err == nil {
				_, err = w.Recv()
			}
			switch {
			case err == nil:
				admitted++
			case status.Code(err) == codes.ResourceExhausted:
				refused++
				if first == nil {
					first = err
				}
			default:
				p("watch", err)
				return
			}
		}
		fmt.Printf("admitted %d refused %d\n", admitted, refused)
		p("first refusal", first)
		// The daemon's goroutines with them all open.
		fmt.Println("HOLDING")
		if _, err := os.Stdin.Read(make([]byte, 1)); err != nil {
			p("stdin", err)
		}
	}
}

// One local user cannot grow the daemon without bound by opening calls
// over one connection (HTTP/2 streams, each a goroutine and buffers in
// kvxferd): the calls of one uid in flight are bounded (-max-calls-per-uid),
// one past it refused at once (ResourceExhausted, counted as
// kvxfer_refused_total{reason="calls_per_uid"}); the daemon's goroutines
// stay bounded and another user's engine carries on. Before, all 3000
// were taken, each holding goroutines in the daemon.
func TestAnotherUserCannotFloodCalls(t *testing.T) {
	dir := world(t)
	metrics := freeAddr(t)
	d := startDaemon(t, dir, "d", "-metrics-listen", metrics)
	v := attachVictim(t, d, dir, "victim")
	before := v.sum()
	base := metricsOf(t, metrics)["go_goroutines"]
	out, release := asNobodyHolding(t, "stream-flood", "KVXFER_SOCK="+d.Sock)
	m := metricsOf(t, metrics)
	release()
	var admitted, refusedN int
	for _, line := range strings.Split(out, "\n") {
		if _, err := fmt.Sscanf(line, "admitted %d refused %d", &admitted, &refusedN); err == nil {
			break
		}
	}
	t.Logf("admitted %d, refused %d; daemon goroutines %v -> %v", admitted, refusedN, base, m["go_goroutines"])
	if admitted > 2048 || refusedN < floodStreams-2048 {
		t.Errorf("one user's %d calls over one connection: %d admitted, %d refused; want at most 2048 admitted (-max-calls-per-uid)", floodStreams, admitted, refusedN)
	}
	refused(t, out, codes.ResourceExhausted, "first refusal")
	if !strings.Contains(out, "-max-calls-per-uid") {
		t.Errorf("the refusal does not name -max-calls-per-uid:\n%s", out)
	}
	if g := m["go_goroutines"] - base; g > 2*2048+256 {
		t.Errorf("the daemon grew by %v goroutines for one user's calls", g)
	}
	if m["kvxfer_refused_total"] < float64(refusedN) || refusedN == 0 {
		t.Errorf("kvxfer_refused_total = %v, want the %d refusals counted", m["kvxfer_refused_total"], refusedN)
	}
	v.intact(t, before)
}

// asNobodyHolding is asNobody for an attack that prints HOLDING and then
// keeps what it opened until release is called (it waits on its stdin).
func asNobodyHolding(t *testing.T, name string, env ...string) (out string, release func()) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("attacks from another local user need root to switch to uid 65534 (setpriv); CI runs as root")
	}
	cmd, buf, stdin := startAsNobody(t, name, env...)
	if !waitFor(buf, "HOLDING") {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("attack %s did not hold:\n%s", name, buf.String())
	}
	var once bool
	release = func() {
		if once {
			return
		}
		once = true
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("attack %s: %v\n%s", name, err, buf.String())
		}
	}
	t.Cleanup(release)
	return buf.String(), release
}

// lockedBuffer is an attack's output, written by its process and read
// while it runs.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// startAsNobody starts attack name as asNobody does, its stdin a pipe the
// caller closes to end it.
func startAsNobody(t *testing.T, name string, env ...string) (*exec.Cmd, *lockedBuffer, io.WriteCloser) {
	t.Helper()
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv (util-linux) is needed to run as another user: %v", err)
	}
	cmd := exec.Command(setpriv, fmt.Sprintf("--reuid=%d", nobody), fmt.Sprintf("--regid=%d", nobody), "--clear-groups",
		os.Args[0], "-test.run=^TestAttackChild$", "-test.v")
	cmd.Env = append(os.Environ(), append([]string{"KVXFER_ATTACK=" + name}, env...)...)
	cmd.Dir = "/"
	buf := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = buf, buf
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, buf, stdin
}

// waitFor waits up to 60 s for buf to hold s.
func waitFor(buf *lockedBuffer, s string) bool {
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if strings.Contains(buf.String(), s) {
			return true
		}
	}
	return false
}

func init() {
	// Claim the engine id the victim is about to use: open its scheduler
	// first, hold it while the victim tries, then exit without closing it
	// (as a crashed engine would).
	attacks["squat-engine"] = func(ctx context.Context, p func(string, error)) {
		cc, err := grpc.NewClient("unix://"+os.Getenv("KVXFER_SOCK"), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			p("dial", err)
			return
		}
		defer cc.Close()
		_, err = pb.NewSchedulerServiceClient(cc).OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{
			EngineId: os.Getenv("KVXFER_VICTIM"), Mode: pb.Mode_MODE_PUSH, TpSize: 1, PpSize: 1, LogicalBlockSize: 16}})
		p("squat", err)
		fmt.Println("HOLDING")
		if _, err := os.Stdin.Read(make([]byte, 1)); err != nil && err != io.EOF {
			p("stdin", err)
		}
	}
}

// Engine ids are first come, first served across local users: while
// another user's engine holds an id (here a scheduler it opened before the
// victim started), the victim's scheduler and ranks under that id are
// refused, PermissionDenied naming the uid that holds it (so the operator
// knows whom to ask). Once that engine's process is gone, the id is free:
// a scheduler it left open (it never closed it) no longer keeps the
// victim out. Before, that scheduler held the id for as long as the daemon
// ran (unless a limit was reached), refusing the victim for ever, and the
// refusal named only the victim's own uid.
func TestSquattedEngineIDFreedWithTheSquatter(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	const id = "victim"
	cmd, buf, stdin := func() (*exec.Cmd, *lockedBuffer, io.WriteCloser) {
		if os.Geteuid() != 0 {
			t.Skip("attacks from another local user need root to switch to uid 65534 (setpriv); CI runs as root")
		}
		return startAsNobody(t, "squat-engine", "KVXFER_SOCK="+d.Sock, "KVXFER_VICTIM="+id)
	}()
	if !waitFor(buf, "HOLDING") || !strings.Contains(buf.String(), "squat: OK") {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("the squatter did not open the scheduler:\n%s", buf.String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cc, err := grpc.NewClient("unix://"+d.Sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	sc := pb.NewSchedulerServiceClient(cc)
	open := func() error {
		_, err := sc.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id, Mode: pb.Mode_MODE_PUSH,
			TpSize: 1, PpSize: 1, LogicalBlockSize: 16, Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}}}})
		return err
	}
	mp, err := shm.Create(dir, "victim-kv", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Remove()
	c, err := stream.Dial("unix://" + d.Sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	connect := func() (*stream.RankStream, error) {
		return c.Connect(ctx, stream.Hello{EngineID: id, Mode: kvxfer.ModePush, Layout: layout(victimBase), CompatHash: "m",
			Memory: []stream.Memory{{Path: mp.Path, Base: victimBase, Size: 4096}}})
	}
	for what, err := range map[string]error{"scheduler": open(), "rank": func() error { _, err := connect(); return err }()} {
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), fmt.Sprintf("uid %d", nobody)) {
			t.Errorf("the victim's %s under an id uid %d holds: %v, want PermissionDenied naming uid %d", what, nobody, err, nobody)
		}
	}
	// The squatter exits without closing its scheduler.
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("squatter: %v\n%s", err, buf.String())
	}
	if err := open(); err != nil {
		t.Fatalf("the victim's scheduler once the squatter is gone: %v", err)
	}
	rs, err := connect()
	if err != nil {
		t.Fatalf("the victim's rank once the squatter is gone: %v", err)
	}
	go func() {
		for range rs.Finished() {
		}
	}()
	if err := rs.Close(ctx); err != nil {
		t.Errorf("close the victim's rank: %v", err)
	}
}

// attacksT are attacks that use the test helpers (a *testing.T of the
// child's own).
var attacksT = map[string]func(t *testing.T, ctx context.Context, p func(string, error)){
	// Attach a P and a D engine of the attacker's own, shrink P's memory
	// file to nothing under the daemon's mapping, and have the daemon
	// move P's blocks to D: the copy out of the shrunk mapping faults
	// (SIGBUS) in the daemon.
	"shrink-own-file": func(t *testing.T, ctx context.Context, p func(string, error)) {
		dir, sock, peer := os.Getenv("KVXFER_DIR"), os.Getenv("KVXFER_SOCK"), os.Getenv("KVXFER_PEER")
		P := attachSim(t, dir, sock, peer, "P", 1, kvxfer.ModePush)
		defer P.Close()
		D := attachSim(t, dir, sock, peer, "D", 2, kvxfer.ModePush)
		defer D.Close()
		ids := []topology.BlockID{1, 2}
		registerD(t, D, "d-1", "t-1", peer, ids)
		finishP(t, P, "p-1", "t-1", ids)
		// Shrunk once P's blocks are filled, before the step that sends them.
		if err := os.Truncate(filepath.Join(dir, "P-tp0"), 0); err != nil {
			p("truncate", err)
			return
		}
		go outcomesOf(t, P, 10*time.Second, "p-1")
		o, ok := outcomesOf(t, D, 10*time.Second, "d-1")["d-1"]
		fmt.Printf("outcome %v %v: %s\n", ok, o.Result, o.Reason)
		p("transfer", nil)
	},
}

// An engine that shrinks its own memory file under the daemon's mapping
// (truncates it) makes the daemon's copies out of it fault (SIGBUS): that
// transfer fails, and the daemon, with another user's engine, carries on.
func TestShrunkMemoryFileFailsOnlyItsTransfer(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	v := attachVictim(t, d, dir, "victim")
	before := v.sum()
	out := asNobody(t, "shrink-own-file", "KVXFER_SOCK="+d.Sock, "KVXFER_DIR="+dir, "KVXFER_PEER="+d.Peer)
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "outcome ") {
			t.Log(line)
		}
	}
	if !strings.Contains(out, "outcome true failed") {
		t.Errorf("D's request out of a shrunk P file: want failed; the attack printed:\n%s", out)
	}
	v.intact(t, before)
}
