package daemon

import "testing"

// GOMAXPROCS is left to the runtime unless its container-aware setting
// is off, in the environment or in the binary's default GODEBUG.
func TestContainerMaxProcsOff(t *testing.T) {
	for _, tc := range []struct {
		def, env string
		want     bool
	}{
		{"", "", false},
		{"", "containermaxprocs=0", true},
		{"", "gctrace=1,containermaxprocs=0", true},
		{"containermaxprocs=0", "", true},
		{"containermaxprocs=0", "containermaxprocs=1", false},
		{"", "containermaxprocs=1", false},
		{"", "updatemaxprocs=0", false},
	} {
		if got := containerMaxProcsOff(tc.def, tc.env); got != tc.want {
			t.Errorf("default %q, GODEBUG %q: off = %v, want %v", tc.def, tc.env, got, tc.want)
		}
	}
}
