package registry_test

import (
	"errors"
	"reflect"
	"testing"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
)

// Whatever etcd holds under the prefix, Decode returns an entry or a
// *BadEntryError, never panics, and an entry it accepts encodes back to
// one it decodes the same.
func FuzzDecode(f *testing.F) {
	f.Add("/kvxfer/engines/P/127.0.0.1:7001", []byte(`{"v":1,"engine_id":"P","role":"producer","mode":"push","compat_hash":"h","tp_size":2,"pp_size":1,"ranks":[{"tp":0,"pp":0,"peer":"127.0.0.1:7001"},{"tp":1,"pp":0,"peer":"127.0.0.1:7001"}],"generation":7,"url":"http://127.0.0.1:8100"}`))
	f.Add("/kvxfer/engines/P/127.0.0.1:7001", []byte(`{"v":1,"engine_id":"P","role":"both","mode":"pull","tp_size":1,"pp_size":1,"ranks":[{"peer":"127.0.0.1:7001"}],"generation":1}`))
	f.Add("/kvxfer/engines/P", []byte(`{}`))
	f.Add("/kvxfer/engines/P/x", []byte(`{"v":1,"ranks":[{"tp":-1}]}`))
	f.Add("/kvxfer/engines/P/[::1]:1", []byte(`null`))
	f.Fuzz(func(t *testing.T, key string, value []byte) {
		e, err := registry.Decode("/kvxfer", key, value)
		if err != nil {
			var be *registry.BadEntryError
			if !errors.As(err, &be) || be.Field == "" {
				t.Fatalf("Decode error %v is not a BadEntryError naming a field", err)
			}
			return
		}
		v, err := e.Encode(key)
		if err != nil {
			t.Fatalf("accepted entry does not encode: %v", err)
		}
		e2, err := registry.Decode("/kvxfer", key, v)
		if err != nil || !reflect.DeepEqual(e, e2) {
			t.Fatalf("re-decoded %+v, %v; want %+v", e2, err, e)
		}
	})
}
