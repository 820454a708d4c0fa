package kvxfer

import "github.com/kvxfer/kvxfer/topology"

// AppendRegMsg encodes a push registration as D rank tpRank of engine
// would send it, for tests that replay or forge peer messages.
func AppendRegMsg(engine string, tpRank, tpSize int, tid, dreq, preq string, spans []topology.Span) []byte {
	return appendMsg(nil, &msg{Kind: msgReg, Engine: engine, Addr: engine + ":1", TPRank: tpRank, TPSize: tpSize, PPSize: 1,
		TransferID: tid, DReq: dreq, PReq: preq, Spans: spans})
}

// AppendDoneMsg encodes a completion notice from rank tpRank of engine.
func AppendDoneMsg(engine string, tpRank, tpSize int, tid, dreq, preq string) []byte {
	return appendMsg(nil, &msg{Kind: msgDone, Engine: engine, TPRank: tpRank, TPSize: tpSize, PPSize: 1, TransferID: tid, DReq: dreq, PReq: preq})
}
