package nixl_test

import (
	"maps"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
)

func TestParseParams(t *testing.T) {
	for _, tc := range []struct {
		list string
		want map[string]string
		err  string
	}{
		{"", map[string]string{}, ""},
		{"ucx_error_handling_mode=none", map[string]string{"ucx_error_handling_mode": "none"}, ""},
		{" a=1, ,b=x=y,c=", map[string]string{"a": "1", "b": "x=y", "c": ""}, ""},
		{"a=1,b", nil, `item "b", want key=value`},
		{"=1", nil, `item "=1", want key=value`},
		// Spaces around '=' are not part of the key or the value.
		{"num_threads = 8, split_batch_size= 128 ,engine_config = RNDV_THRESH=8k",
			map[string]string{"num_threads": "8", "split_batch_size": "128", "engine_config": "RNDV_THRESH=8k"}, ""},
		{" = 1", nil, `item "= 1", want key=value`},
		// A key given twice is refused, naming it: one of the two would be lost.
		{"num_threads=8,num_threads=2", nil, `key "num_threads" given twice`},
		{"num_threads=8, num_threads =2", nil, `key "num_threads" given twice`},
	} {
		got, err := nixl.ParseParams(tc.list)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseParams(%q) = %v, %v; want an error containing %q", tc.list, got, err, tc.err)
			}
			continue
		}
		if err != nil || !maps.Equal(got, tc.want) {
			t.Errorf("ParseParams(%q) = %v, %v; want %v", tc.list, got, err, tc.want)
		}
	}
}
