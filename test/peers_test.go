package test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/peerauth"
	"github.com/kvxfer/kvxfer/internal/peerauth/pkitest"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// dataPort returns the built-in backend's data address of the victim's
// rank, read from a handshake made with the daemon's secret (an outsider
// could also scan for it: the port is no secret, only what it serves).
func dataPort(t *testing.T, d *daemontest.Proc, dir, engine string) string {
	t.Helper()
	return agentLines(t, d, dir, engine)[2]
}

// dataSocket returns the rank's same-host socket (an abstract unix
// socket: any process of the host's network namespace can find it).
func dataSocket(t *testing.T, d *daemontest.Proc, dir, engine string) string {
	t.Helper()
	lines := agentLines(t, d, dir, engine)
	if len(lines) < 4 || !strings.HasPrefix(lines[3], "unix @") {
		t.Fatalf("the rank's agent metadata names no same-host socket: %q", lines)
	}
	return strings.TrimPrefix(lines[3], "unix ")
}

// agentLines returns the lines of the rank's built-in agent metadata:
// the format's name, the agent's name, its TCP address, and its same-host
// socket.
func agentLines(t *testing.T, d *daemontest.Proc, dir, engine string) []string {
	t.Helper()
	secret, err := peerauth.LoadSecret(filepath.Join(dir, "peer.secret"))
	if err != nil {
		t.Fatal(err)
	}
	a, err := peerauth.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(d.Peer, grpc.WithTransportCredentials(server.PeerCredentials(a, "test")))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := pb.NewPeerServiceClient(cc).Handshake(ctx, &pb.HandshakeRequest{EngineId: engine})
	if err != nil {
		t.Fatal(err)
	}
	var list pb.RankList
	if err := proto.Unmarshal(r.Payload, &list); err != nil || len(list.Ranks) != 1 {
		t.Fatalf("handshake payload: %v, %d ranks", err, len(list.Ranks))
	}
	lines := strings.Split(string(list.Ranks[0].Agent), "\n")
	if len(lines) < 3 {
		t.Fatalf("agent metadata %q", list.Ranks[0].Agent)
	}
	return lines
}

// An outsider who finds a rank's data port (or its same-host socket)
// cannot write into its KV cache nor send it notifications: without the
// secret the connection is cut before any request is read.
func TestDataPortNeedsTheSecret(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	v := attachVictim(t, d, dir, "victim")
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			addr := dataPort(t, d, dir, v.id)
			if network == "unix" {
				addr = dataSocket(t, d, dir, v.id)
			}
			unauthenticatedWrite(t, d, dir, v, network, addr)
		})
	}
}

func unauthenticatedWrite(t *testing.T, d *daemontest.Proc, dir string, v *victim, network, addr string) {
	before := v.sum()
	nc, err := net.Dial(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	// The built-in backend's plain hello, then a WRITE of 8 bytes at the
	// start of the victim's region (the address a handshake would give).
	name := "evil"
	w := append([]byte("KVXN"), 1)
	w = binary.LittleEndian.AppendUint16(w, uint16(len(name)))
	w = append(w, name...)
	w = append(w, 1) // WRITE
	w = binary.LittleEndian.AppendUint64(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 0)
	w = binary.LittleEndian.AppendUint32(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 0)
	w = binary.LittleEndian.AppendUint64(w, uint64(v.realBase(t, d, dir)))
	w = binary.LittleEndian.AppendUint64(w, 8)
	w = append(w, "XXXXXXXX"...)
	_, _ = nc.Write(w)
	_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 64)
	for {
		if _, err := nc.Read(buf); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Error("the data port kept an unauthenticated connection open")
			}
			break
		}
	}
	time.Sleep(100 * time.Millisecond)
	v.intact(t, before)
}

// realBase is where the victim's region lives in the daemon (what a
// handshake tells peers).
func (v *victim) realBase(t *testing.T, d *daemontest.Proc, dir string) uint64 {
	t.Helper()
	return rankOf(t, clusterAuth(t, dir), v.id, d.Peer).Layout.Regions[0].Base
}

var simModel = kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}

func simEngine(id, tp int) kvsim.Engine {
	return kvsim.Engine{ID: id, TP: tp, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 16}
}

// outcome steps e until its ranks report req's outcome (bounded).
func outcome(e *simengine.Engine, req string, within time.Duration) (kvxfer.Outcome, error) {
	for deadline := time.Now().Add(within); time.Now().Before(deadline); {
		if err := e.Step(e.Sched.BuildMeta()); err != nil {
			return kvxfer.Outcome{}, err
		}
		for i, rs := range e.Streams {
			select {
			case f := <-rs.Finished():
				out, err := e.Fold(i, &f)
				if err != nil {
					return kvxfer.Outcome{}, err
				}
				if out == nil {
					continue
				}
				for _, o := range append(out.Sending, out.Recving...) {
					if o.ReqID == req {
						return o, nil
					}
				}
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	return kvxfer.Outcome{}, fmt.Errorf("no outcome for %s in %v", req, within)
}

// Two daemons with different secrets (or one with none) cannot transfer:
// D's request fails at once with the reason, P's daemon logs the refusal,
// and nothing hangs. The same pair with one secret transfers.
func TestDaemonsNeedTheSameSecret(t *testing.T) {
	tlsArgs := func(t *testing.T, ca *pkitest.CA, dir, name string) []string {
		f, err := ca.Issue(dir, name)
		if err != nil {
			t.Fatal(err)
		}
		return []string{"-tls-cert", f.Cert, "-tls-key", f.Key, "-tls-ca", f.CA}
	}
	for _, tc := range []struct {
		name          string
		pArgs, dArgs  []string
		tls           string // "": no TLS; "same": both certificates of one CA; "rogue": D's of another
		ok            bool
		dReason, pLog string
	}{
		{name: "mutual TLS", tls: "same", ok: true},
		{name: "TLS, D's certificate of another CA", tls: "rogue", dReason: "mutual TLS: the peer must present a certificate", pLog: "TLS: "},
		{name: "same secret", ok: true},
		{name: "different secrets", dArgs: []string{"-peer-secret-file", "OTHER"},
			dReason: "its proof does not match our secret", pLog: "same -peer-secret-file"},
		{name: "D insecure", dArgs: []string{"-insecure-peers"},
			dReason: "this daemon runs with -insecure-peers", pLog: "not a kvxfer peer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := world(t)
			other := filepath.Join(t.TempDir(), "other.secret")
			if err := os.WriteFile(other, []byte("another secret, 16+ bytes long"), 0o600); err != nil {
				t.Fatal(err)
			}
			for i, a := range tc.dArgs {
				if a == "OTHER" {
					tc.dArgs[i] = other
				}
			}
			if tc.tls != "" {
				certs := t.TempDir()
				ca, err := pkitest.NewCA(certs, "cluster")
				if err != nil {
					t.Fatal(err)
				}
				dca := ca
				if tc.tls == "rogue" {
					if dca, err = pkitest.NewCA(certs, "rogue"); err != nil {
						t.Fatal(err)
					}
				}
				tc.pArgs = tlsArgs(t, ca, certs, "p")
				tc.dArgs = tlsArgs(t, dca, certs, "d")
				tc.dArgs[len(tc.dArgs)-1] = ca.Path // D trusts the cluster's CA; its own certificate is the rogue's
			}
			p := startDaemon(t, dir, "P", tc.pArgs...)
			d := startDaemon(t, dir, "D", tc.dArgs...)
			m := simModel
			P, err := simengine.Attach(simengine.Config{Dir: dir, Sock: p.Sock, Peer: p.Peer, ID: "P", Model: &m, Engine: simEngine(1, 1),
				Mode: kvxfer.ModePush, Version: "test"})
			if err != nil {
				t.Fatal(err)
			}
			defer P.Close()
			D, err := simengine.Attach(simengine.Config{Dir: dir, Sock: d.Sock, Peer: d.Peer, ID: "D", Model: &m, Engine: simEngine(2, 1),
				Mode: kvxfer.ModePush, Version: "test"})
			if err != nil {
				t.Fatal(err)
			}
			defer D.Close()
			ids := []topology.BlockID{1, 2}
			dReq := &kvxfer.Request{ID: "d-1", PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: "t1", DoRemotePrefill: true,
				RemoteEngineID: "P", RemoteAddr: p.Peer, RemoteTPSize: 1}}
			ext, _ := D.Sched.MatchedTokens(dReq, 0)
			if err := D.Sched.AfterAlloc(dReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}, External: ext}); err != nil {
				t.Fatal(err)
			}
			if err := D.Step(D.Sched.BuildMeta()); err != nil {
				t.Fatal(err)
			}
			pReq := &kvxfer.Request{ID: "p-1", PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: "t1", DoRemoteDecode: true}}
			if err := P.Sched.AfterAlloc(pReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}}); err != nil {
				t.Fatal(err)
			}
			if _, _, err := P.Sched.RequestFinished(pReq, kvxfer.FinishLengthCapped, [][]topology.BlockID{ids}, 32); err != nil {
				t.Fatal(err)
			}
			pDone := make(chan kvxfer.Outcome, 1)
			pWait := 10 * time.Second
			if !tc.ok {
				// P's request waits for a registration that cannot come; its
				// registration timeout ends it (not waited for here).
				pWait = time.Second
			}
			go func() { o, _ := outcome(P, "p-1", pWait); pDone <- o }()
			start := time.Now()
			o, err := outcome(D, "d-1", 20*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if tc.ok {
				if o.Result != kvxfer.ResultDone {
					t.Errorf("D: %+v, want done", o)
				}
				if po := <-pDone; po.Result != kvxfer.ResultDone {
					t.Errorf("P: %+v, want done", po)
				}
				return
			}
			if o.Result != kvxfer.ResultFailed || !strings.Contains(o.Reason, tc.dReason) {
				t.Errorf("D: %+v, want failed with %q", o, tc.dReason)
			}
			t.Logf("D failed after %v: %s", time.Since(start).Round(time.Millisecond), o.Reason)
			<-pDone
			var log []byte
			// Waited for (P logs as it refuses, its daemon as slow as the
			// machine), up to 15 s: a line that never comes fails all the same.
			for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
				if log, _ = os.ReadFile(p.Log); bytes.Contains(log, []byte(tc.pLog)) {
					break
				}
			}
			if !bytes.Contains(log, []byte(tc.pLog)) {
				t.Errorf("P's log does not say %q:\n%s", tc.pLog, log)
			}
		})
	}
}

// Even a peer that holds the secret reaches only what a request grants it
// on the built-in data plane: with no request of the victim's in flight,
// its WRITE into the victim's KV cache and its READ of it are refused,
// nothing lands, and the daemon drops the connection and logs why.
func TestAuthenticatedPeerNeedsAGrant(t *testing.T) {
	dir := world(t)
	d := startDaemon(t, dir, "d")
	v := attachVictim(t, d, dir, "victim")
	before := v.sum()
	au := clusterAuth(t, dir)
	rank := rankOf(t, au, v.id, d.Peer)
	evil, err := tcp.New(tcp.Config{Name: "evil", Auth: au, DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	defer evil.Close()
	mine := bytes.Repeat([]byte{0xEE}, 4096)
	const myBase = 1 << 30
	if err := evil.Map(myBase, mine); err != nil {
		t.Fatal(err)
	}
	if err := evil.Register([]kvxfer.MemRegion{{Addr: myBase, Len: 4096, Kind: kvxfer.MemDRAM}}); err != nil {
		t.Fatal(err)
	}
	peer, err := evil.LoadPeer(rank.Agent)
	if err != nil {
		t.Fatal(err)
	}
	target := rank.Layout.Regions[0].Base
	for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
		id, err := evil.Post(op, peer, []hotpath.Desc{{Local: myBase, Remote: target, Len: 256}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		state := kvxfer.XferInProgress
		for deadline := time.Now().Add(10 * time.Second); state == kvxfer.XferInProgress && time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			state, err = evil.State(id)
		}
		if state != kvxfer.XferFailed {
			t.Errorf("%v of the victim's cache by an authenticated peer: %v (%v), want failed", op, state, err)
		}
	}
	if !bytes.Equal(mine, bytes.Repeat([]byte{0xEE}, 4096)) {
		t.Error("the READ brought the victim's bytes")
	}
	v.intact(t, before)
	deadline := time.Now().Add(10 * time.Second)
	for {
		log, _ := os.ReadFile(d.Log)
		if bytes.Count(log, []byte("no grant for the range")) >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the daemon's log does not say why it refused twice:\n%s", log)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// forgedNotice encodes a peer message as the wire format describes it
// (kvxfer/wire.go): magic, version, kind, the sender's engine, address and
// ranks, the request's ids, no spans, no ids, a reason.
func forgedNotice(kind byte, engine, addr, tid, dreq, preq, reason string) []byte {
	str := func(b []byte, s string) []byte { return append(binary.AppendUvarint(b, uint64(len(s))), s...) }
	b := []byte{'K', 1, kind}
	b = str(str(b, engine), addr)
	for _, v := range []int64{0, 1, 0, 1} { // tp rank, tp size, pp rank, pp size
		b = binary.AppendVarint(b, v)
	}
	b = str(str(str(b, tid), dreq), preq)
	b = binary.AppendUvarint(b, 0) // spans
	b = binary.AppendUvarint(b, 0) // ids
	return str(b, reason)
}

// A daemon that holds the secret still cannot speak for another engine:
// its forged completion and failure notices, naming the producer of a
// request D waits for, change nothing; D's log says why, and the real
// transfer ends done.
func TestForgedNoticeFromAuthenticatedPeer(t *testing.T) {
	dir := world(t)
	p := startDaemon(t, dir, "P")
	d := startDaemon(t, dir, "D")
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	defer P.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	ids := []topology.BlockID{1, 2}
	registerD(t, D, "d-1", "t-1", p.Peer, ids)
	// The forger: the cluster's secret, its own agent, D's rank loaded from
	// a handshake.
	au := clusterAuth(t, dir)
	evil, err := tcp.New(tcp.Config{Name: "evil", Auth: au, DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	defer evil.Close()
	peer, err := evil.LoadPeer(rankOf(t, au, "D", d.Peer).Agent)
	if err != nil {
		t.Fatal(err)
	}
	const done, fail = 2, 6
	for _, kind := range []byte{done, fail} {
		if err := evil.Notify(peer, forgedNotice(kind, "P", p.Peer, "t-1", "d-1", "p-1", "forged")); err != nil {
			t.Fatal(err)
		}
	}
	if o, ok := outcomesOf(t, D, 2*time.Second, "d-1")["d-1"]; ok {
		t.Fatalf("D reported %+v on forged notices", o)
	}
	// The real producer finishes: D's request is done.
	finishP(t, P, "p-1", "t-1", ids)
	go func() { _ = outcomesOf(t, P, 20*time.Second, "p-1") }()
	if o := outcomesOf(t, D, 20*time.Second, "d-1")["d-1"]; o.Result != kvxfer.ResultDone {
		t.Fatalf("D: %+v; want done", o)
	}
	wantBytes(t, D, "t-1", ids)
	log, _ := os.ReadFile(d.Log)
	if n := bytes.Count(log, []byte("does not speak for its sender")); n != 2 {
		t.Errorf("D's log names %d forged notices, want 2:\n%s", n, log)
	}
}

// clusterAuth is what a peer holding dir's shared secret authenticates
// with.
func clusterAuth(t *testing.T, dir string) *peerauth.Authenticator {
	t.Helper()
	secret, err := peerauth.LoadSecret(filepath.Join(dir, "peer.secret"))
	if err != nil {
		t.Fatal(err)
	}
	au, err := peerauth.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	return au
}

// rankOf handshakes, as au, with a one-rank engine at addr and returns the
// rank.
func rankOf(t *testing.T, au *peerauth.Authenticator, engine, addr string) kvxfer.RankInfo {
	t.Helper()
	res, err := server.NewPeerResolver(server.ResolverConfig{Creds: server.PeerCredentials(au, "t")}).Handshake(context.Background(), engine, addr)
	if err != nil || len(res.Ranks) != 1 {
		t.Fatalf("handshake %s: %v", engine, err)
	}
	return res.Ranks[0]
}
