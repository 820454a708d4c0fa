package kvxfer

import (
	"fmt"
	"testing"
)

// knowEngine completes a handshake of core st with engine (tp ranks,
// agents ENGINE/0...), as its driver would once asked: its messages are
// admitted from then on.
func knowEngine(t *testing.T, st *loopState, engine string, tp int) {
	t.Helper()
	st.ensureEngine(engine, engine+":1")
	tc := &traceCore{st: st, now: st.now, fail: map[opKind]int{}}
	tc.drive(nil, "")
	tc.run(t, fmt.Sprintf("handshake %s tp=%d", engine, tp))
}
