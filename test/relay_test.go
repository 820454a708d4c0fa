package test

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// relay joins two network namespaces through a TUN device in each, the
// test copying IP packets between them: it delays every packet, drops a
// share of them (spread evenly), or drops them all (a partition). This kernel
// has no netem; this is the network the fault suite needs.
type relay struct {
	a, b     string // namespaces
	aIP, bIP string
	ta, tb   *os.File
	delay    atomic.Int64 // ns
	loss     atomic.Int64 // per mille
	cut      atomic.Bool
	dropped  atomic.Int64
	passed   atomic.Int64
	count    atomic.Int64 // packets seen
}

// openTun makes TUN device name in namespace ns and returns its file.
func openTun(t *testing.T, ns, name string) *os.File {
	t.Helper()
	type res struct {
		f   *os.File
		err error
	}
	ch := make(chan res, 1)
	go func() {
		// The thread enters ns and is not given back to the scheduler
		// (it ends with this goroutine): the device is made there.
		runtime.LockOSThread()
		target, err := unix.Open("/var/run/netns/"+ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			ch <- res{err: err}
			return
		}
		defer unix.Close(target)
		if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
			ch <- res{err: fmt.Errorf("setns %s: %w", ns, err)}
			return
		}
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			ch <- res{err: err}
			return
		}
		ifr, err := unix.NewIfreq(name)
		if err == nil {
			ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI)
			err = unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr)
		}
		if err == nil {
			err = unix.SetNonblock(fd, true)
		}
		if err != nil {
			unix.Close(fd)
			ch <- res{err: fmt.Errorf("tun %s in %s: %w", name, ns, err)}
			return
		}
		ch <- res{f: os.NewFile(uintptr(fd), name)}
	}()
	r := <-ch
	if r.err != nil {
		t.Skipf("cannot make a TUN device: %v", r.err)
	}
	return r.f
}

func newRelay(t *testing.T) *relay {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("a relayed network needs root to make network namespaces and TUN devices; CI runs as root")
	}
	id := fmt.Sprintf("%d", rand.IntN(1<<20))
	sub := 1 + rand.IntN(250)
	r := &relay{a: "kvra" + id, b: "kvrb" + id, aIP: fmt.Sprintf("10.214.%d.1", sub), bIP: fmt.Sprintf("10.214.%d.2", sub)}
	t.Cleanup(func() {
		_ = exec.Command("ip", "netns", "del", r.a).Run()
		_ = exec.Command("ip", "netns", "del", r.b).Run()
	})
	for _, ns := range []string{r.a, r.b} {
		if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
			t.Skipf("cannot make a network namespace: %v: %s", err, out)
		}
	}
	r.ta, r.tb = openTun(t, r.a, "tun0"), openTun(t, r.b, "tun0")
	for _, c := range [][]string{
		{"-n", r.a, "addr", "add", r.aIP + "/24", "dev", "tun0"}, {"-n", r.b, "addr", "add", r.bIP + "/24", "dev", "tun0"},
		{"-n", r.a, "link", "set", "lo", "up"}, {"-n", r.b, "link", "set", "lo", "up"},
		{"-n", r.a, "link", "set", "tun0", "up"}, {"-n", r.b, "link", "set", "tun0", "up"},
	} {
		if out, err := exec.Command("ip", c...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(c, " "), err, out)
		}
	}
	done := make(chan struct{}, 2)
	go r.pump(r.ta, r.tb, done)
	go r.pump(r.tb, r.ta, done)
	t.Cleanup(func() {
		r.ta.Close()
		r.tb.Close()
		<-done
		<-done
	})
	return r
}

// pump copies packets from src to dst, delayed, some dropped.
func (r *relay) pump(src, dst *os.File, done chan<- struct{}) {
	defer func() { done <- struct{}{} }()
	buf := make([]byte, 1<<16)
	for {
		n, err := src.Read(buf)
		if err != nil {
			return
		}
		// Loss: exactly loss‰ of the packets, spread evenly (a packet whose
		// count crosses the next multiple), so a short run always loses some.
		c, loss := r.count.Add(1), r.loss.Load()
		if r.cut.Load() || c*loss/1000 != (c-1)*loss/1000 {
			r.dropped.Add(1)
			continue
		}
		r.passed.Add(1)
		pkt := append([]byte(nil), buf[:n]...)
		if d := time.Duration(r.delay.Load()); d > 0 {
			time.AfterFunc(d, func() { _, _ = dst.Write(pkt) })
		} else {
			_, _ = dst.Write(pkt)
		}
	}
}

// P and D on two hosts joined by a relayed link with 20 ms of delay each
// way and 2% of packets lost: requests are done, byte for byte. The link
// then drops everything: requests waiting on P fail within 10 s, naming
// it. It comes back: a new request is done.
func TestDelayLossAndPartitionThroughARelay(t *testing.T) {
	r := newRelay(t)
	r.delay.Store(int64(20 * time.Millisecond))
	r.loss.Store(20)
	dir := world(t)
	p := startDaemonIn(t, r.a, dir, "P", "-peer-listen", r.aIP+":0", "-data-host", r.aIP, "-metrics-listen", "127.0.0.1:9700")
	d := startDaemonIn(t, r.b, dir, "D", "-peer-listen", r.bIP+":0", "-data-host", r.bIP, "-metrics-listen", "127.0.0.1:9700")
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	defer P.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	var dIDs, pIDs []string
	for i := range 4 {
		id := fmt.Sprintf("%c", 'a'+i)
		ids := []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}
		registerD(t, D, "d-"+id, "t-"+id, p.Peer, ids)
		finishP(t, P, "p-"+id, "t-"+id, ids)
		dIDs, pIDs = append(dIDs, "d-"+id), append(pIDs, "p-"+id)
	}
	pOut := make(chan map[string]kvxfer.Outcome, 1)
	go func() { pOut <- outcomesOf(t, P, 30*time.Second, pIDs...) }()
	got := outcomesOf(t, D, 30*time.Second, dIDs...)
	po := <-pOut
	for i, id := range dIDs {
		if got[id].Result != kvxfer.ResultDone || po[pIDs[i]].Result != kvxfer.ResultDone {
			t.Fatalf("%s over a slow, lossy link: D %+v, P %+v; want done", id, got[id], po[pIDs[i]])
		}
		wantBytes(t, D, "t-"+id[2:], []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)})
	}
	if r.dropped.Load() == 0 {
		t.Error("the relay dropped no packet: the loss was not tested")
	}
	t.Logf("over 20 ms each way and 2%% loss: %d packets passed, %d dropped", r.passed.Load(), r.dropped.Load())
	pBase, dBase := metricsIn(t, r.a, "127.0.0.1:9700")["go_goroutines"], metricsIn(t, r.b, "127.0.0.1:9700")["go_goroutines"]

	// A partition: everything is dropped.
	for i := range 2 {
		id := fmt.Sprintf("w%d", i)
		registerD(t, D, "d-"+id, "t-"+id, p.Peer, []topology.BlockID{topology.BlockID(10 + 2*i), topology.BlockID(11 + 2*i)})
	}
	regsReachP(t, 2, 10*time.Second, func() map[string]float64 { return metricsIn(t, r.a, "127.0.0.1:9700") })
	r.cut.Store(true)
	cut := time.Now()
	got = outcomesOf(t, D, 10*time.Second, "d-w0", "d-w1")
	for _, id := range []string{"d-w0", "d-w1"} {
		if o, ok := got[id]; !ok || o.Result != kvxfer.ResultFailed || !strings.Contains(o.Reason, "producer engine P") {
			t.Errorf("%s: %+v (reported %v), want failed within 10 s naming producer engine P", id, o, ok)
		}
	}
	t.Logf("waiting requests ended %v into the partition", time.Since(cut).Round(time.Millisecond))
	r.cut.Store(false)
	transferOnce(t, P, D, p.Peer, "new", []topology.BlockID{14, 15}, 20*time.Second, "after the partition healed")
	settledIn(t, "P's daemon", r.a, "127.0.0.1:9700", pBase, 10)
	settledIn(t, "D's daemon", r.b, "127.0.0.1:9700", dBase, 10)
}

// metricsIn scrapes the /metrics of a daemon in network namespace ns
// (from a thread that enters it: the namespaces are not reachable from
// here otherwise), summed by metric name.
func metricsIn(t *testing.T, ns, addr string) map[string]float64 {
	t.Helper()
	type res struct {
		body string
		err  error
	}
	ch := make(chan res, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		fd, err := unix.Open("/var/run/netns/"+ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err == nil {
			err = unix.Setns(fd, unix.CLONE_NEWNET)
			unix.Close(fd)
		}
		if err != nil {
			ch <- res{err: err}
			return
		}
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			ch <- res{err: err}
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(c, "GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n", addr)
		b, err := io.ReadAll(c)
		ch <- res{string(b), err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatalf("scrape %s in %s: %v", addr, ns, r.err)
	}
	return parseMetrics(r.body)
}

// settledIn is settled for a daemon in a network namespace.
func settledIn(t *testing.T, name, ns, addr string, baseline, slack float64) {
	t.Helper()
	var m map[string]float64
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		m = metricsIn(t, ns, addr)
		if m["kvxfer_requests_open"] == 0 && m["kvxfer_transfers_in_flight"] == 0 && m["go_goroutines"] <= baseline+slack {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("%s after the scenario: %v requests open, %v transfers in flight, %v goroutines (%v before)",
				name, m["kvxfer_requests_open"], m["kvxfer_transfers_in_flight"], m["go_goroutines"], baseline)
			return
		}
	}
	t.Logf("%s after the scenario: no request open, %v goroutines (%v before, %v allowed)", name, m["go_goroutines"], baseline, baseline+slack)
}
