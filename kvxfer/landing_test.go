package kvxfer_test

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// stallProxy forwards TCP connections to target. Armed, it forwards half
// of the next chunk each connection sends towards target and then holds
// the rest, until released: a link that goes quiet in the middle of a
// frame and heals later.
type stallProxy struct {
	ln     net.Listener
	target string

	// back: it holds back what the server sends the client (a READ's
	// answer), not what the client sends.
	back bool

	mu       sync.Mutex
	armed    bool
	stalled  int           // connections holding bytes back
	released chan struct{} // closed by release
	conns    []net.Conn
}

func newStallProxy(t *testing.T, target string) *stallProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{ln: ln, target: target, released: make(chan struct{})}
	go p.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		p.release()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
	})
	return p
}

func (p *stallProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		if p.back {
			go func() { _, _ = io.Copy(s, c); _ = s.Close() }()
			go p.forward(s, c)
			continue
		}
		go func() { _, _ = io.Copy(c, s); _ = c.Close() }()
		go p.forward(c, s)
	}
}

func (p *stallProxy) forward(from, to net.Conn) {
	defer func() { _ = to.Close() }()
	// Armed, it forwards all but the last hold bytes it was sent, and
	// keeps those until released: the frame stops short of its end. It
	// starts at the first read of more than a hello's longest message
	// (versionBound's first, at most 611 bytes): a frame's payload, not a
	// connection's hello, is what stalls.
	const hold, hello = 256, 1024
	buf := make([]byte, 1<<20)
	var held []byte
	for {
		n, err := from.Read(buf)
		if n > 0 {
			p.mu.Lock()
			armed := p.armed && (held != nil || n > hello)
			if armed && held == nil {
				p.stalled++
			}
			p.mu.Unlock()
			if armed {
				held = append(held, buf[:n]...)
				if k := len(held) - hold; k > 0 {
					if _, err := to.Write(held[:k]); err != nil {
						return
					}
					held = held[k:]
				}
				go func() { <-p.released; _ = from.SetReadDeadline(time.Now()) }()
			} else {
				if len(held) > 0 {
					if _, err := to.Write(held); err != nil {
						return
					}
					held = held[:0]
				}
				if _, err := to.Write(buf[:n]); err != nil {
					return
				}
			}
		}
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			// Released: what was held goes on, and the link carries on.
			_ = from.SetReadDeadline(time.Time{})
			if len(held) > 0 {
				if _, err := to.Write(held); err != nil {
					return
				}
				held = held[:0]
			}
			continue
		}
		if err != nil {
			return
		}
	}
}

func (p *stallProxy) arm() { p.mu.Lock(); p.armed = true; p.mu.Unlock() }

func (p *stallProxy) stalledConns() int { p.mu.Lock(); defer p.mu.Unlock(); return p.stalled }

func (p *stallProxy) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.armed = false
	select {
	case <-p.released:
	default:
		close(p.released)
	}
}

// A WRITE part admitted into D's blocks, its payload held up by a link
// that went quiet mid-frame: D gives the producer up (its probes fail for
// PeerTimeout) and, the producer unable to confirm its cancel, reports at
// its fence timeout, revoking its grant; the engine reuses the blocks; the link heals well within the data
// plane's frame timeout. Not one of the part's bytes may land after D
// reported: the grant's revocation cuts the part short and returns only
// once it stopped moving bytes.
func TestRevokeCutsLandingShort(t *testing.T) {
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	dir := kvxfertest.NewDirectory()
	fast := func(c *kvxfer.WorkerConfig) { c.PeerTimeout = 2 * time.Second } // the partition is found by it; 500 ms left a loaded machine little room before it
	tcpOnly := tcp.Config{DisableLocal: true, DisableSameHost: true, Conns: 1}
	p := startEngineOn(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, fast, func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		return tcpBackend(t, name, r, tcpOnly), nil
	})
	var proxy *stallProxy
	fence := func(c *kvxfer.WorkerConfig) { fast(c); c.FenceTimeout = time.Second }
	d := startEngineOn(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "D", kvxfer.ModePush, fence, func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		// D's agent listens on a port of its own and advertises the proxy.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		listen := l.Addr().String()
		_ = l.Close()
		proxy = newStallProxy(t, listen)
		c := tcpOnly
		c.Listen, c.Advertise = listen, proxy.ln.Addr().String()
		return tcpBackend(t, name, r, c), nil
	})
	t.Cleanup(func() { d.close(t); p.close(t) })
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(1, 2))
	q := makeRequest("a", 160, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	p.ranks[0][0].Scramble(1)
	p.ranks[0][0].Fill(q.sim.P)
	d.ranks[0][0].Scramble(2)

	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p, now.Add(time.Minute))}})
	awaitRegistration(t, p)
	proxy.arm()
	p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
	for deadline := time.Now().Add(10 * time.Second); proxy.stalledConns() == 0; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("P's WRITE never reached the proxy")
		}
	}
	time.Sleep(50 * time.Millisecond) // D's agent admits the part and waits for the rest
	// The partition: D hears nothing more from P.
	dir.FailHandshakes("P", 1<<20)
	out := awaitOutcomes(t, 1, d) // D gives the request up
	if o := out.recv["d-a"][0]; o.Result != kvxfer.ResultFailed {
		t.Fatalf("D's outcome %+v, want failed", o)
	}
	// The engine takes its blocks back at once and reuses them.
	reused := bytes.Repeat([]byte{0xAB}, len(d.ranks[0][0].Mem))
	copy(d.ranks[0][0].Mem, reused)
	// The link heals, long before the frame timeout.
	proxy.release()
	for deadline := time.Now().Add(20 * time.Second); len(out.send["p-a"]) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("P's request never ended")
		}
		out.collect(t, p)
	}
	time.Sleep(100 * time.Millisecond)
	if !bytes.Equal(d.ranks[0][0].Mem, reused) {
		n := 0
		for i, b := range d.ranks[0][0].Mem {
			if b != reused[i] {
				n++
			}
		}
		t.Fatalf("%d bytes of P's WRITE landed in D's blocks after D reported them free", n)
	}
	if s := d.workers[0][0].Metrics().Snapshot().RefusedAccess; s["write_aborted"] != 1 {
		t.Errorf("D refusals %v, want one write_aborted", s)
	}
}

// A pull consumer's READ whose answer is held up by a link that went
// quiet mid-payload: D gives the producer up (its probes fail for
// PeerTimeout) and, with the data plane's grants, reports at once,
// releasing the READ; the engine reuses the blocks; the link heals. Not
// one byte of the answer may land after D reported: releasing the READ
// cuts its landing short and returns only once it stopped.
func TestReleaseCutsReadLandingShort(t *testing.T) {
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	dir := kvxfertest.NewDirectory()
	fast := func(c *kvxfer.WorkerConfig) { c.PeerTimeout = 2 * time.Second } // the partition is found by it; 500 ms left a loaded machine little room before it
	tcpOnly := tcp.Config{DisableLocal: true, DisableSameHost: true, Conns: 1}
	var proxy *stallProxy
	// (P's close at the end waits for a request whose READ was cut short
	// no longer than a second: its notices go through the stalled proxy.)
	fastP := func(c *kvxfer.WorkerConfig) { fast(c); c.CloseTimeout = time.Second }
	p := startEngineOn(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePull, fastP, func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		// P's agent listens on a port of its own and advertises the proxy.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		listen := l.Addr().String()
		_ = l.Close()
		proxy = newStallProxy(t, listen)
		proxy.back = true
		c := tcpOnly
		c.Listen, c.Advertise = listen, proxy.ln.Addr().String()
		return tcpBackend(t, name, r, c), nil
	})
	d := startEngineOn(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "D", kvxfer.ModePull, fast, func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		return tcpBackend(t, name, r, tcpOnly), nil
	})
	t.Cleanup(func() { d.close(t); p.close(t) })
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(1, 2))
	q := makeRequest("a", 160, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	p.ranks[0][0].Scramble(1)
	p.ranks[0][0].Fill(q.sim.P)
	d.ranks[0][0].Scramble(2)

	now := time.Now()
	p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
	proxy.arm()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePull, p, now.Add(time.Minute))}})
	for deadline := time.Now().Add(10 * time.Second); proxy.stalledConns() == 0; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("P's answer never reached the proxy")
		}
	}
	time.Sleep(50 * time.Millisecond) // D's agent reads the answer and waits for the rest
	// The partition: D hears nothing more from P.
	dir.FailHandshakes("P", 1<<20)
	out := awaitOutcomes(t, 1, d) // D gives the request up
	if o := out.recv["d-a"][0]; o.Result != kvxfer.ResultFailed {
		t.Fatalf("D's outcome %+v, want failed", o)
	}
	// The engine takes its blocks back at once and reuses them.
	reused := bytes.Repeat([]byte{0xAB}, len(d.ranks[0][0].Mem))
	copy(d.ranks[0][0].Mem, reused)
	// The link heals.
	proxy.release()
	time.Sleep(200 * time.Millisecond)
	if !bytes.Equal(d.ranks[0][0].Mem, reused) {
		n := 0
		for i, b := range d.ranks[0][0].Mem {
			if b != reused[i] {
				n++
			}
		}
		t.Fatalf("%d bytes of the READ's answer landed in D's blocks after D reported them free", n)
	}
}
