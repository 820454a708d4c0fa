package daemon

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
)

// The registry's flags are kvxferd serve's and the in-process JSON's
// alike; bad values are refused naming the flag; without -etcd nothing
// of the registry starts.
func TestEtcdFlags(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string // error substring; "" for valid
	}{
		{name: "off by default", args: nil},
		{name: "on", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-role", "producer", "-etcd-url", "http://127.0.0.1:8100"}},
		{name: "bad role", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-role", "kv_producer"}, want: `-etcd-role = "kv_producer"`},
		{name: "short ttl", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-ttl", "1s"}, want: "-etcd-ttl = 1s"},
		{name: "fractional ttl", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-ttl", "2500ms"}, want: "-etcd-ttl = 2.5s"},
		{name: "bad url", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-url", "ftp://x"}, want: `-etcd-url = "ftp://x"`},
		{name: "remote plain text", args: []string{"-etcd", "10.1.2.3:2379"}, want: "-etcd-insecure"},
		{name: "max engines", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-max-engines", "0"}, want: "-etcd-max-engines = 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseFlags(tc.args)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("parseFlags(%q) = %v", tc.args, err)
				}
				if len(tc.args) == 0 && (c.etcd.client.Endpoints != "" || c.etcd.ttl != registry.DefaultTTL) {
					t.Errorf("defaults: %+v", c.etcd)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("parseFlags(%q) = %v, want an error with %q", tc.args, err, tc.want)
			}
		})
	}
	c, err := parseJSON([]byte(`{"etcd": "127.0.0.1:2379", "etcd_role": "consumer", "etcd-ttl": "3s"}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.etcd.client.Endpoints != "127.0.0.1:2379" || c.etcd.role != "consumer" || c.etcd.ttl.String() != "3s" {
		t.Errorf("parseJSON: %+v", c.etcd)
	}
}
