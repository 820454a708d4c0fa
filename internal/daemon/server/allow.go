package server

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
)

// ErrPeerNotAllowed is the error of a peer address outside the allow-list
// (AllowList.Check).
var ErrPeerNotAllowed = errors.New("peer address not allowed")

// AllowList is the peer addresses a daemon may dial when engines name them
// (kvxferd -peer-allow): IP prefixes (10.0.0.0/8, ::1/128), single IPs and
// host names, each matching any port. Host names match exactly as written
// (they are not resolved: an engine cannot reach an address by naming a
// host that resolves to it). The zero AllowList allows nothing; a nil one
// is not consulted.
type AllowList struct {
	prefixes []netip.Prefix
	hosts    map[string]bool
}

// ParseAllowList parses a comma-separated list; an empty list is an
// error (leave the flag unset to allow every address).
func ParseAllowList(list string) (*AllowList, error) {
	a := &AllowList{hosts: map[string]bool{}}
	for _, item := range strings.Split(list, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		if p, err := netip.ParsePrefix(item); err == nil {
			a.prefixes = append(a.prefixes, p.Masked())
			continue
		}
		if ip, err := netip.ParseAddr(item); err == nil {
			a.prefixes = append(a.prefixes, netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen()))
			continue
		}
		if !hostName(item) {
			return nil, fmt.Errorf("peer allow-list item %q: want an IP, an IP prefix (10.0.0.0/8) or a host name", item)
		}
		a.hosts[strings.ToLower(item)] = true
	}
	if len(a.prefixes) == 0 && len(a.hosts) == 0 {
		return nil, errors.New("peer allow-list is empty")
	}
	return a, nil
}

// hostName reports whether s can be a host name as a peer's address
// names it: dot-separated labels of letters, digits, '-' and '_' (1 to 63
// each, no '-' at either end), 253 bytes at most. An item that cannot be
// one (a typo such as "10.0.0.0./8", "???") matches nothing: refused, it
// is not a list that silently allows less than meant.
func hostName(s string) bool {
	if len(s) == 0 || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(strings.TrimSuffix(s, "."), ".") {
		if len(label) == 0 || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
				return false
			}
		}
	}
	return true
}

// Check returns nil when addr (host:port) is allowed, else an error
// wrapping ErrPeerNotAllowed that names it.
func (a *AllowList) Check(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%w: %q: %v", ErrPeerNotAllowed, addr, err)
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		ip = ip.Unmap()
		for _, p := range a.prefixes {
			if p.Contains(ip) {
				return nil
			}
		}
	} else if a.hosts[strings.ToLower(host)] {
		return nil
	}
	return fmt.Errorf("%w: %s is not in kvxferd's -peer-allow list", ErrPeerNotAllowed, addr)
}
