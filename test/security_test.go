package test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/peerauth"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// TestMain lets the suites start this test binary as kvxferd daemons
// (daemontest) and as backend agents (kvxfertest.AgentCommand).
func TestMain(m *testing.M) {
	daemontest.ServeIfChild()
	kvxfertest.ServeAgentIfChild()
	os.Exit(m.Run())
}

// The security suite: each test performs an attack on a real kvxferd
// process as an outsider would (another local user, or anyone who reaches
// the peer port) and checks it is refused and the victim engine's bytes
// and requests are untouched.

// nobody is the uid/gid attacks from another local user run as.
const nobody = 65534

// world is a directory every local user can reach and create files in
// (like /dev/shm: mode 1777), holding a daemon's socket and shm files. It
// is removed when the test ends.
func world(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvxfer-sec-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o1777); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// startDaemon runs a kvxferd whose socket every local user may connect to
// (-socket-mode 0666: engines are told apart by uid).
func startDaemon(t *testing.T, dir, name string, extra ...string) *daemontest.Proc {
	t.Helper()
	d, err := daemontest.Start(dir, name, daemonBackend, append([]string{"-socket-mode", "0666"}, extra...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(); err != nil {
			t.Errorf("stop %s: %v", name, err)
		}
		if t.Failed() {
			b, _ := os.ReadFile(d.Log)
			t.Logf("%s log:\n%s", name, b)
		}
	})
	return d
}

// layout is a small one-rank layout whose region starts at base.
func layout(base uint64) topology.Layout {
	return topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND,
		Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16,
		Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: base, BlockLen: 256, NumBlocks: 16}}}
}

// victim is an engine of this test's user (root in CI) attached to a
// daemon: its scheduler open and one rank whose KV cache is a 0600 shm
// file holding a known pattern.
type victim struct {
	id     string
	client *stream.Client
	rank   *stream.RankStream
	mem    *shm.Mapping
	sched  pb.SchedulerServiceClient
}

const victimBase = 1 << 20

func attachVictim(t *testing.T, d *daemontest.Proc, dir, id string) *victim {
	t.Helper()
	mp, err := shm.Create(dir, id+"-kv", 4096)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mp.Remove() })
	for i := range mp.Bytes {
		mp.Bytes[i] = byte(i*7 + 3)
	}
	c, err := stream.Dial("unix://" + d.Sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cc, err := grpc.NewClient("unix://"+d.Sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	sc := pb.NewSchedulerServiceClient(cc)
	if _, err := sc.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id, Mode: pb.Mode_MODE_PUSH,
		TpSize: 1, PpSize: 1, LogicalBlockSize: 16, Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}}}}); err != nil {
		t.Fatal(err)
	}
	rs, err := c.Connect(ctx, stream.Hello{EngineID: id, Mode: kvxfer.ModePush, Layout: layout(victimBase), CompatHash: "m",
		Memory: []stream.Memory{{Path: mp.Path, Base: victimBase, Size: 4096}}})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for range rs.Finished() {
		}
	}()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = rs.Close(ctx)
	})
	return &victim{id: id, client: c, rank: rs, mem: mp, sched: sc}
}

func (v *victim) sum() [32]byte { return sha256.Sum256(v.mem.Bytes) }

// intact checks the victim's bytes still hash to before and its scheduler
// and rank still work.
func (v *victim) intact(t *testing.T, before [32]byte) {
	t.Helper()
	if v.sum() != before {
		t.Errorf("victim %s: its KV bytes changed", v.id)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := v.sched.Step(ctx, &pb.StepRequest{EngineId: v.id, BuildMeta: true}); err != nil {
		t.Errorf("victim %s: its scheduler: %v", v.id, err)
	}
	if err := v.rank.Step(&kvxfer.StepMeta{}); err != nil {
		t.Errorf("victim %s: its rank: %v", v.id, err)
	}
}

// asNobody runs attack name in this test binary re-executed as uid/gid
// 65534 (setpriv), with env, and returns what it printed. It skips the
// test when this process cannot switch users.
func asNobody(t *testing.T, name string, env ...string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("attacks from another local user need root to switch to uid 65534 (setpriv); CI runs as root")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv (util-linux) is needed to run as another user: %v", err)
	}
	cmd := exec.Command(setpriv, fmt.Sprintf("--reuid=%d", nobody), fmt.Sprintf("--regid=%d", nobody), "--clear-groups",
		os.Args[0], "-test.run=^TestAttackChild$", "-test.v")
	cmd.Env = append(os.Environ(), append([]string{"KVXFER_ATTACK=" + name}, env...)...)
	cmd.Dir = "/"
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("attack %s did not end in 60 s:\n%s", name, out.String())
	}
	if !strings.Contains(out.String(), "ATTACK DONE") {
		t.Fatalf("attack %s did not run to its end:\n%s", name, out.String())
	}
	return out.String()
}

// attacks are the child's side of asNobody: each prints one line per
// attempt, "<what>: <grpc code>: <message>".
var attacks = map[string]func(ctx context.Context, p func(what string, err error)){
	// Attach a rank under the victim's engine id (its own rank's slot, and
	// one not taken yet), with the attacker's own shm file.
	"attach-victim-engine": func(ctx context.Context, p func(string, error)) {
		c, err := stream.Dial("unix://" + os.Getenv("KVXFER_SOCK"))
		if err != nil {
			p("dial", err)
			return
		}
		defer c.Close()
		dir := os.Getenv("KVXFER_DIR")
		mp, err := shm.Create(dir, fmt.Sprintf("nobody-%d", os.Getpid()), 4096)
		if err != nil {
			p("create", err)
			return
		}
		defer mp.Remove()
		l := layout(victimBase)
		_, err = c.Connect(ctx, stream.Hello{EngineID: os.Getenv("KVXFER_VICTIM"), Mode: kvxfer.ModePush, Layout: l,
			Memory: []stream.Memory{{Path: mp.Path, Base: victimBase, Size: 4096}}})
		p("same rank", err)
		l.TPSize, l.TPRank, l.TotalKVHeads = 2, 1, 2
		_, err = c.Connect(ctx, stream.Hello{EngineID: os.Getenv("KVXFER_VICTIM"), Mode: kvxfer.ModePush, Layout: l,
			Memory: []stream.Memory{{Path: mp.Path, Base: victimBase, Size: 4096}}})
		p("free rank", err)
	},
	// Use, replace and close the victim's scheduler.
	"victim-scheduler": func(ctx context.Context, p func(string, error)) {
		cc, err := grpc.NewClient("unix://"+os.Getenv("KVXFER_SOCK"), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			p("dial", err)
			return
		}
		defer cc.Close()
		sc := pb.NewSchedulerServiceClient(cc)
		id := os.Getenv("KVXFER_VICTIM")
		_, err = sc.Step(ctx, &pb.StepRequest{EngineId: id, BuildMeta: true})
		p("step", err)
		_, err = sc.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id, Mode: pb.Mode_MODE_PUSH,
			TpSize: 1, PpSize: 1, LogicalBlockSize: 16, Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}}}})
		p("open", err)
		_, err = sc.CloseScheduler(ctx, &pb.CloseSchedulerRequest{EngineId: id})
		p("close", err)
	},
}

// mapAs attaches a rank of the attacker's own engine whose memory is the
// file at path and prints the daemon's answer.
func mapAs(ctx context.Context, p func(string, error), what, engine, path string) {
	c, err := stream.Dial("unix://" + os.Getenv("KVXFER_SOCK"))
	if err != nil {
		p("dial", err)
		return
	}
	defer c.Close()
	rs, err := c.Connect(ctx, stream.Hello{EngineID: engine, Mode: kvxfer.ModePush, Layout: layout(victimBase),
		Memory: []stream.Memory{{Path: path, Base: victimBase, Size: 4096}}})
	if err == nil {
		_ = rs.Close(ctx)
	}
	// The path, which differs by case, is left out of what is compared.
	if err != nil {
		err = status.Error(status.Code(err), strings.ReplaceAll(status.Convert(err).Message(), path, "PATH"))
	}
	p(what, err)
}

func init() {
	// Make the root daemon map files of another user: the victim's
	// (named directly, and through a symlink the attacker made in the shm
	// dir), a root-only file outside the shm dir through a symlink, and a
	// file that does not exist. Then the attacker's own file, which works.
	attacks["map-others-files"] = func(ctx context.Context, p func(string, error)) {
		dir := os.Getenv("KVXFER_DIR")
		victimFile, secret := os.Getenv("KVXFER_VICTIM_FILE"), os.Getenv("KVXFER_SECRET")
		link := filepath.Join(dir, fmt.Sprintf("link-%d", os.Getpid()))
		if err := os.Symlink(victimFile, link); err != nil {
			p("symlink", err)
			return
		}
		defer os.Remove(link)
		link2 := filepath.Join(dir, fmt.Sprintf("link2-%d", os.Getpid()))
		if err := os.Symlink(secret, link2); err != nil {
			p("symlink", err)
			return
		}
		defer os.Remove(link2)
		mapAs(ctx, p, "victim's file", "nobody-a", victimFile)
		mapAs(ctx, p, "symlink to it", "nobody-b", link)
		mapAs(ctx, p, "symlink out of the dir", "nobody-c", link2)
		mapAs(ctx, p, "missing file", "nobody-d", filepath.Join(dir, "no-such-file"))
		mapAs(ctx, p, "root's world-readable file", "nobody-f", os.Getenv("KVXFER_READABLE"))
		mapAs(ctx, p, "root's world-writable file", "nobody-g", os.Getenv("KVXFER_WRITABLE"))
		mapAs(ctx, p, "the daemon's own descriptor", "nobody-h", "/proc/self/fd/0")
		mapAs(ctx, p, "out of the dir by ..", "nobody-i", filepath.Join(dir, "..", filepath.Base(dir), "..", "etc", "passwd"))
		if err := os.Link(victimFile, filepath.Join(dir, fmt.Sprintf("hard-%d", os.Getpid()))); err == nil {
			// Only where fs.protected_hardlinks is off.
			defer os.Remove(filepath.Join(dir, fmt.Sprintf("hard-%d", os.Getpid())))
			mapAs(ctx, p, "hard link to it", "nobody-j", filepath.Join(dir, fmt.Sprintf("hard-%d", os.Getpid())))
		}
		mp, err := shm.Create(dir, fmt.Sprintf("own-%d", os.Getpid()), 4096)
		if err != nil {
			p("create", err)
			return
		}
		defer mp.Remove()
		mapAs(ctx, p, "own file", "nobody-e", mp.Path)
	}
}

func init() {
	// Make the root daemon map a file of the attacker's own uid that the
	// attacker cannot reach: it lies in a root-only directory. Then one in
	// a directory the attacker may search through its group, which works.
	attacks["map-unsearchable"] = func(ctx context.Context, p func(string, error)) {
		if f, err := os.OpenFile(os.Getenv("KVXFER_HIDDEN"), os.O_RDWR, 0); err == nil {
			f.Close()
			p("open it itself", nil) // the attacker reaches it: the test is wrong
		}
		mapAs(ctx, p, "file in a root-only directory", "nobody-a", os.Getenv("KVXFER_HIDDEN"))
		mapAs(ctx, p, "file in its group's directory", "nobody-b", os.Getenv("KVXFER_GROUP_FILE"))
	}
}

// TestAttackChild runs one attack for asNobody (KVXFER_ATTACK names it);
// run directly, it does nothing.
func TestAttackChild(t *testing.T) {
	name := os.Getenv("KVXFER_ATTACK")
	if name == "" {
		return
	}
	attack := attacks[name]
	if a := attacksT[name]; a != nil {
		attack = func(ctx context.Context, p func(string, error)) { a(t, ctx, p) }
	}
	if attack == nil {
		t.Fatalf("no attack %q", name)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	attack(ctx, func(what string, err error) {
		fmt.Printf("%s: %v: %v\n", what, status.Code(err), err)
	})
	fmt.Println("ATTACK DONE")
}

// refused checks out has the line "<what>: <code>: ..." for each of whats.
func refused(t *testing.T, out string, code codes.Code, whats ...string) {
	t.Helper()
	for _, w := range whats {
		if !strings.Contains(out, "\n"+w+": "+code.String()+": ") && !strings.HasPrefix(out, w+": "+code.String()+": ") {
			t.Errorf("%s: want %v; the attack printed:\n%s", w, code, out)
		}
	}
}

// Another local user cannot attach ranks under an engine id that belongs
// to the victim, neither its attached rank's slot nor a free one.
func TestAnotherUserCannotJoinAnEngine(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	v := attachVictim(t, d, dir, "victim")
	before := v.sum()
	out := asNobody(t, "attach-victim-engine", "KVXFER_SOCK="+d.Sock, "KVXFER_DIR="+dir, "KVXFER_VICTIM="+v.id)
	refused(t, out, codes.PermissionDenied, "same rank", "free rank")
	v.intact(t, before)
}

// Another local user cannot use, replace or close the victim's scheduler.
func TestAnotherUserCannotTouchASchedulerItDidNotOpen(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	v := attachVictim(t, d, dir, "victim")
	before := v.sum()
	out := asNobody(t, "victim-scheduler", "KVXFER_SOCK="+d.Sock, "KVXFER_VICTIM="+v.id)
	refused(t, out, codes.PermissionDenied, "step", "open", "close")
	v.intact(t, before)
}

// Another local user cannot make the daemon (root) map a file it does not
// own: the victim's KV cache file named directly or through a symlink, a
// root-only file outside the shm dir, nor learn whether a file exists (the
// errors are identical); its own file maps.
func TestAnotherUserCannotMapOthersFiles(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	v := attachVictim(t, d, dir, "victim")
	before := v.sum()
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, bytes.Repeat([]byte("s"), 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	// Files of root's in the shm dir that uid 65534 may read, or even
	// write, itself: the daemon maps only files the engine's uid owns.
	readable, writable := filepath.Join(dir, "readable"), filepath.Join(dir, "writable")
	for f, mode := range map[string]os.FileMode{readable: 0o644, writable: 0o666} {
		if err := os.WriteFile(f, bytes.Repeat([]byte("r"), 4096), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(f, mode); err != nil {
			t.Fatal(err)
		}
	}
	out := asNobody(t, "map-others-files", "KVXFER_SOCK="+d.Sock, "KVXFER_DIR="+dir, "KVXFER_VICTIM_FILE="+v.mem.Path, "KVXFER_SECRET="+secret,
		"KVXFER_READABLE="+readable, "KVXFER_WRITABLE="+writable)
	refused(t, out, codes.PermissionDenied, "victim's file", "symlink to it", "symlink out of the dir", "missing file",
		"root's world-readable file", "root's world-writable file", "the daemon's own descriptor", "out of the dir by ..")
	if strings.Contains(out, "hard link to it: ") {
		refused(t, out, codes.PermissionDenied, "hard link to it")
	}
	var msgs []string
	for _, line := range strings.Split(out, "\n") {
		if _, msg, ok := strings.Cut(line, ": PermissionDenied: "); ok {
			msgs = append(msgs, msg)
		}
	}
	for _, m := range msgs[1:] {
		if m != msgs[0] {
			t.Errorf("refusals differ (they must reveal nothing):\n%s\n%s", msgs[0], m)
		}
	}
	if !strings.Contains(out, "own file: OK: <nil>") {
		t.Errorf("the attacker's own file was not mapped:\n%s", out)
	}
	if b, _ := os.ReadFile(secret); !bytes.Equal(b, bytes.Repeat([]byte("s"), 4096)) {
		t.Error("the root-only file changed")
	}
	v.intact(t, before)
}

// The peer port answers only daemons holding the secret: an outsider
// learns nothing from a handshake (no layout, no address) and reaches no
// engine service; a daemon with the secret reaches the Peer service only.
func TestPeerPortNeedsTheSecret(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	v := attachVictim(t, d, dir, "victim")
	before := v.sum()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	outsider, err := grpc.NewClient(d.Peer, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer outsider.Close()
	if r, err := pb.NewPeerServiceClient(outsider).Handshake(ctx, &pb.HandshakeRequest{EngineId: v.id}); err == nil || status.Code(err) != codes.Unavailable {
		t.Errorf("handshake without the secret = %v, %v; want the connection refused (Unavailable)", r, err)
	}
	if _, err := pb.NewSchedulerServiceClient(outsider).CloseScheduler(ctx, &pb.CloseSchedulerRequest{EngineId: v.id}); status.Code(err) != codes.Unavailable {
		t.Errorf("SchedulerService without the secret: %v, want Unavailable", err)
	}
	wrong, err := peerauth.New([]byte("not-the-secret-of-this-daemon"))
	if err != nil {
		t.Fatal(err)
	}
	wc, err := grpc.NewClient(d.Peer, grpc.WithTransportCredentials(server.PeerCredentials(wrong, "x")))
	if err != nil {
		t.Fatal(err)
	}
	defer wc.Close()
	if _, err := pb.NewPeerServiceClient(wc).Handshake(ctx, &pb.HandshakeRequest{EngineId: v.id}); status.Code(err) != codes.Unavailable ||
		!strings.Contains(err.Error(), "its proof does not match our secret") {
		t.Errorf("handshake with another secret: %v", err)
	}
	// A peer with the secret: the Peer service answers, engine services
	// are not there.
	secret, err := peerauth.LoadSecret(filepath.Join(dir, "peer.secret"))
	if err != nil {
		t.Fatal(err)
	}
	good, err := peerauth.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	pc, err := grpc.NewClient(d.Peer, grpc.WithTransportCredentials(server.PeerCredentials(good, "peer")))
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	if r, err := pb.NewPeerServiceClient(pc).Handshake(ctx, &pb.HandshakeRequest{EngineId: v.id}); err != nil || len(r.Payload) == 0 {
		t.Errorf("handshake with the secret = %v, %v", r, err)
	}
	if _, err := pb.NewSchedulerServiceClient(pc).CloseScheduler(ctx, &pb.CloseSchedulerRequest{EngineId: v.id}); status.Code(err) != codes.Unimplemented {
		t.Errorf("SchedulerService on the peer port: %v, want Unimplemented", err)
	}
	if st, err := pb.NewWorkerServiceClient(pc).Connect(ctx); err == nil {
		if _, err := st.Recv(); status.Code(err) != codes.Unimplemented {
			t.Errorf("WorkerService on the peer port: %v, want Unimplemented", err)
		}
	}
	v.intact(t, before)
}

// Another local user cannot make the daemon (root) map a file, even one
// it owns, in a directory beneath the shm dir that it cannot search (a
// root-only directory): the daemon touches nothing the engine's own uid
// could not. A directory it may search through its group is fine.
func TestAnotherUserCannotMapThroughADirectoryItCannotSearch(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	mk := func(sub string, gid int, mode os.FileMode) string {
		t.Helper()
		sd := filepath.Join(dir, sub)
		if err := os.Mkdir(sd, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(sd, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(sd, 0, gid); err != nil {
			t.Fatal(err)
		}
		f := filepath.Join(sd, "kv")
		if err := os.WriteFile(f, bytes.Repeat([]byte("s"), 4096), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(f, nobody, nobody); err != nil {
			t.Fatal(err)
		}
		return f
	}
	if os.Geteuid() != 0 {
		t.Skip("attacks from another local user need root to switch to uid 65534 (setpriv); CI runs as root")
	}
	hidden := mk("root-only", 0, 0o700)
	groupFile := mk("group", nobody, 0o710)
	out := asNobody(t, "map-unsearchable", "KVXFER_SOCK="+d.Sock, "KVXFER_HIDDEN="+hidden, "KVXFER_GROUP_FILE="+groupFile)
	if strings.Contains(out, "open it itself") {
		t.Fatalf("uid %d can open %s itself:\n%s", nobody, hidden, out)
	}
	refused(t, out, codes.PermissionDenied, "file in a root-only directory")
	if !strings.Contains(out, "file in its group's directory: OK: <nil>") {
		t.Errorf("the file in a directory of the attacker's group was not mapped:\n%s", out)
	}
	if b, _ := os.ReadFile(hidden); !bytes.Equal(b, bytes.Repeat([]byte("s"), 4096)) {
		t.Error("the hidden file changed")
	}
}
