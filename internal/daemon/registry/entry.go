package registry

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// Version is the entry format this package writes and reads.
const Version = 1

// Limits on what an entry may hold: an entry is input from whoever may
// write to etcd, so what it makes a reader keep is bounded.
const (
	MaxValueBytes = 64 << 10
	maxIDBytes    = 256
	maxRanks      = 4096
)

// Roles an entry may declare (vLLM's kv_role without the "kv_").
const (
	RoleProducer = "producer"
	RoleConsumer = "consumer"
	RoleBoth     = "both"
)

// Entry is what one kvxferd publishes about one engine it serves: what
// peers need to find the engine's ranks and what routers need to pair it.
// Nothing in it is secret, and nothing in it is trusted: a daemon that
// resolves an engine through an entry still authenticates the peer it
// dials (-peer-secret-file or mutual TLS), and the data-plane grants still
// decide what that peer may touch.
type Entry struct {
	V          int    `json:"v"`
	EngineID   string `json:"engine_id"`
	Role       string `json:"role"`
	Mode       string `json:"mode"` // "push" or "pull"
	CompatHash string `json:"compat_hash"`
	TPSize     int    `json:"tp_size"`
	PPSize     int    `json:"pp_size"`
	Ranks      []Rank `json:"ranks"`
	// Generation is the engine's handshake generation at the publishing
	// daemon: it changes whenever the engine's ranks change (a restart).
	Generation uint64 `json:"generation"`
	// URL is the engine's serving URL (its OpenAI server), where known.
	URL string `json:"url,omitempty"`
	// created is the etcd revision that created the entry's key (View):
	// of an engine's entries, the one created last is current.
	created int64
}

// Rank is one rank of an engine and the Peer service that serves it.
type Rank struct {
	TP   int    `json:"tp"`
	PP   int    `json:"pp"`
	Peer string `json:"peer"` // host:port
}

// Peer is the Peer service address that serves e's ranks (a kvxferd
// serves all of an engine's ranks it holds on one address).
func (e *Entry) Peer() string {
	if len(e.Ranks) == 0 {
		return ""
	}
	return e.Ranks[0].Peer
}

// BadEntryError is an entry refused by Decode: Field names what is wrong
// and Value what it held.
type BadEntryError struct {
	Key, Field, Value, Want string
}

func (e *BadEntryError) Error() string {
	return fmt.Sprintf("registry: entry %q: %s = %s, want %s", e.Key, e.Field, e.Value, e.Want)
}

// ErrBadEntry is matched by every BadEntryError (errors.Is).
var ErrBadEntry = errors.New("registry: bad entry")

// Is makes errors.Is(err, ErrBadEntry) hold.
func (e *BadEntryError) Is(target error) bool { return target == ErrBadEntry }

func bad(key, field string, value any, want string) error {
	v := fmt.Sprint(value)
	if s, ok := value.(string); ok {
		v = strconv.Quote(s)
	}
	if len(v) > 80 {
		v = v[:77] + "..."
	}
	return &BadEntryError{Key: key, Field: field, Value: v, Want: want}
}

// Keys: <prefix>/engines/<engine id>/<publisher>, the publisher being the
// Peer service address of the daemon that wrote it. One engine may have
// entries from several daemons (the in-process placement runs a server
// per worker process).

// EnginesPrefix is where entries live under prefix.
func EnginesPrefix(prefix string) string { return strings.TrimRight(prefix, "/") + "/engines/" }

// Key is the key of an entry of engine published by the daemon at peer.
func Key(prefix, engine, peer string) string { return EnginesPrefix(prefix) + engine + "/" + peer }

// Encode validates e and returns its value.
func (e *Entry) Encode(key string) ([]byte, error) {
	e.V = Version
	if err := e.validate(key); err != nil {
		return nil, err
	}
	return json.Marshal(e)
}

// Decode parses and validates the value of key (under prefix). Its error
// is a *BadEntryError naming the field and the value.
func Decode(prefix, key string, value []byte) (Entry, error) {
	if len(value) > MaxValueBytes {
		return Entry{}, bad(key, "value", fmt.Sprintf("%d bytes", len(value)), fmt.Sprintf("at most %d bytes", MaxValueBytes))
	}
	var e Entry
	dec := json.NewDecoder(strings.NewReader(string(value)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		return Entry{}, bad(key, "value", err.Error(), "a JSON object of the registry's entry format")
	}
	// One object and nothing after it: a value with more (a second
	// object, bytes a writer left) is not one a registrar wrote.
	if _, err := dec.Token(); err != io.EOF {
		return Entry{}, bad(key, "value", fmt.Sprintf("data after the entry's object at byte %d", dec.InputOffset()), "one JSON object")
	}
	rest, ok := strings.CutPrefix(key, EnginesPrefix(prefix))
	engine, peer, ok2 := strings.Cut(rest, "/")
	if !ok || !ok2 || engine == "" || peer == "" {
		return Entry{}, bad(key, "key", key, EnginesPrefix(prefix)+"<engine>/<peer address>")
	}
	if e.EngineID != engine {
		return Entry{}, bad(key, "engine_id", e.EngineID, fmt.Sprintf("%q (the key's)", engine))
	}
	if err := e.validate(key); err != nil {
		return Entry{}, err
	}
	if e.Peer() != peer {
		return Entry{}, bad(key, "ranks[0].peer", e.Peer(), fmt.Sprintf("%q (the key's)", peer))
	}
	return e, nil
}

// validate checks every field of e, naming the first bad one.
func (e *Entry) validate(key string) error {
	switch {
	case e.V != Version:
		return bad(key, "v", e.V, strconv.Itoa(Version))
	case !validEngineID(e.EngineID):
		return bad(key, "engine_id", e.EngineID, fmt.Sprintf("1 to %d bytes, no space, control character or slash", maxIDBytes))
	case e.Role != RoleProducer && e.Role != RoleConsumer && e.Role != RoleBoth:
		return bad(key, "role", e.Role, "producer, consumer or both")
	case e.Mode != "push" && e.Mode != "pull":
		return bad(key, "mode", e.Mode, "push or pull")
	case len(e.CompatHash) > maxIDBytes:
		return bad(key, "compat_hash", e.CompatHash, fmt.Sprintf("at most %d bytes", maxIDBytes))
	case e.TPSize < 1 || e.TPSize > 1<<16:
		return bad(key, "tp_size", e.TPSize, "1 to 65536")
	case e.PPSize < 1 || e.PPSize > 1<<16:
		return bad(key, "pp_size", e.PPSize, "1 to 65536")
	case len(e.Ranks) == 0 || len(e.Ranks) > min(maxRanks, e.TPSize*e.PPSize):
		return bad(key, "ranks", fmt.Sprintf("%d ranks", len(e.Ranks)), fmt.Sprintf("1 to tp_size*pp_size (%d)", min(maxRanks, e.TPSize*e.PPSize)))
	case e.Generation == 0:
		return bad(key, "generation", e.Generation, "> 0")
	}
	seen := make(map[[2]int]bool, len(e.Ranks))
	for i, r := range e.Ranks {
		f := fmt.Sprintf("ranks[%d]", i)
		if seen[[2]int{r.TP, r.PP}] {
			return bad(key, f, fmt.Sprintf("tp %d pp %d", r.TP, r.PP), "each rank once")
		}
		seen[[2]int{r.TP, r.PP}] = true
		switch {
		case r.TP < 0 || r.TP >= e.TPSize:
			return bad(key, f+".tp", r.TP, fmt.Sprintf("0 to %d", e.TPSize-1))
		case r.PP < 0 || r.PP >= e.PPSize:
			return bad(key, f+".pp", r.PP, fmt.Sprintf("0 to %d", e.PPSize-1))
		case r.Peer != e.Ranks[0].Peer:
			return bad(key, f+".peer", r.Peer, fmt.Sprintf("%q (one entry is one daemon's)", e.Ranks[0].Peer))
		}
		if err := checkHostPort(r.Peer); err != nil {
			return bad(key, f+".peer", r.Peer, PeerWant)
		}
	}
	if e.URL != "" && CheckURL(e.URL) != nil {
		return bad(key, "url", e.URL, URLWant)
	}
	return nil
}

// What an entry's peer and URL must be (for errors that name them).
const (
	PeerWant = "host:port (a host name or IP, a port of 1 to 65535)"
	URLWant  = "an http or https base URL without credentials, query or fragment"
)

// CheckPeer says whether addr may be an entry's peer (PeerWant): a
// daemon checks the address it will publish at start.
func CheckPeer(addr string) error { return checkHostPort(addr) }

// CheckURL says whether s may be an entry's URL (URLWant).
func CheckURL(s string) error {
	u, err := url.Parse(s)
	if err != nil {
		return err
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" {
		return errors.New("not " + URLWant)
	}
	return nil
}

// checkHostPort accepts what a daemon dials a peer at (the resolver's
// checkPeerAddr, internal/daemon/server): a host name or an IP, and a
// port of digits. An entry's peer is handed on as it is (to resolvers,
// to routers as remote_host), so one the dialer would refuse ("[unix:/
// path]:1", a host with spaces or control characters, a port "+80") is
// refused here, where it is counted and logged, instead of becoming an
// engine's current address.
func checkHostPort(hp string) error {
	host, ps, err := net.SplitHostPort(hp)
	if err != nil {
		return err
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port <= 0 || port > 65535 || strings.Trim(ps, "0123456789") != "" || host == "" {
		return errors.New("bad port or host")
	}
	if strings.Contains(host, ":") {
		if _, err := netip.ParseAddr(host); err != nil {
			return errors.New("bad host")
		}
		return nil
	}
	if strings.ContainsFunc(host, func(c rune) bool {
		return !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_')
	}) {
		return errors.New("bad host")
	}
	return nil
}

// Field is the field a Decode error names ("other" for any other error),
// for metrics.
func Field(err error) string {
	var b *BadEntryError
	if errors.As(err, &b) {
		if i := strings.IndexByte(b.Field, '['); i >= 0 {
			if j := strings.IndexByte(b.Field, ']'); j > i {
				return b.Field[:i] + "[]" + b.Field[j+1:] // ranks[3].peer -> ranks[].peer: bounded labels
			}
		}
		return b.Field
	}
	return "other"
}

// validEngineID reports whether id can name an engine in the registry: 1
// to maxIDBytes bytes, no space, control character or slash (a key's
// separator).
func validEngineID(id string) bool {
	return id != "" && len(id) <= maxIDBytes && !strings.ContainsFunc(id, func(r rune) bool { return r <= ' ' || r == '/' })
}
