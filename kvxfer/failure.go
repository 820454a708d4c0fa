package kvxfer

import "fmt"

// FailureKind says why a request failed or expired, as a value metrics,
// engines and peers can act on; Outcome.Reason stays free text for people.
// The names (String) follow the reference's failure types in its logs
// (SPEC §10) where one exists.
type FailureKind uint8

const (
	// FailureNone: the outcome is not a failure (done, or aborted by
	// the engine).
	FailureNone FailureKind = iota
	// FailureHandshake: the handshake with the peer engine failed.
	FailureHandshake
	// FailureIncompatible: the peer answered, but its layout, TP size
	// or compatibility hash rules out a transfer.
	FailureIncompatible
	// FailureRegistration: a push consumer could not send its
	// registration to a producer rank.
	FailureRegistration
	// FailureSetup: a transfer could not be set up: the peer's blocks
	// or registration were refused, or the backend refused the post.
	FailureSetup
	// FailureTransfer: a WRITE or READ failed while moving bytes.
	FailureTransfer
	// FailureNotification: a completion notice could not be sent.
	FailureNotification
	// FailureExpired: a lease or deadline passed first.
	FailureExpired
	// FailurePeerGone: the peer stopped answering or restarted
	// (WorkerConfig.PeerTimeout).
	FailurePeerGone
	// FailurePeer: the peer failed the request and said why only in
	// words (a peer of an earlier build).
	FailurePeer
	// FailureCancelled: the other side gave up on the request (its
	// engine aborted it, or it cancelled after a failure of its own).
	FailureCancelled
	// FailureClosed: the Worker closed with the request open.
	FailureClosed

	numFailureKinds
)

var failureNames = [numFailureKinds]string{
	FailureNone:         "none",
	FailureHandshake:    "handshake_failed",
	FailureIncompatible: "handshake_setup_failed",
	FailureRegistration: "push_reg_notif_failed",
	FailureSetup:        "transfer_setup_failed",
	FailureTransfer:     "transfer_failed",
	FailureNotification: "notification_failed",
	FailureExpired:      "expired",
	FailurePeerGone:     "peer_gone",
	FailurePeer:         "peer_failure",
	FailureCancelled:    "cancelled",
	FailureClosed:       "worker_closed",
}

func (k FailureKind) String() string {
	if k < numFailureKinds {
		return failureNames[k]
	}
	return fmt.Sprintf("FailureKind(%d)", uint8(k))
}

// FailureKinds lists every kind, FailureNone first (for metrics).
func FailureKinds() []FailureKind {
	out := make([]FailureKind, numFailureKinds)
	for i := range out {
		out[i] = FailureKind(i)
	}
	return out
}
