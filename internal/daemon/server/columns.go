package server

import (
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// Row flags of RequestColumns.flags.
const (
	colRemotePrefill = 1 << iota
	colRemoteDecode
	colNoParams
)

// at is column col's entry for row i; an empty column holds the zero value
// in every row (clients leave out columns that are all defaults).
func at[T any](col []T, i int) T {
	if len(col) == 0 {
		var zero T
		return zero
	}
	return col[i]
}

// blockOrStatus are the columns that do not have one entry per row, or
// none: status (every request_finished row) and the block columns (one
// per row and group, and the ids).
var blockOrStatus = map[string]bool{"status": true, "block_lens": true, "block_ids": true,
	"remote_block_lens": true, "remote_block_starts": true, "remote_block_ids": true}

// columnOps expands a step's columns into the ops they stand for, in the
// order they apply: request_finished rows, after_alloc rows, prefill rows.
// Columns whose lengths disagree are refused whole, naming the column.
func columnOps(c *pb.StepColumns) ([]*pb.SchedulerOp, error) {
	if c == nil {
		return nil, nil
	}
	var ops []*pb.SchedulerOp
	for _, kind := range []struct {
		name string
		rc   *pb.RequestColumns
		op   func(r *pb.EngineRequest, blocks []*pb.BlockList, rc *pb.RequestColumns, i int) *pb.SchedulerOp
	}{
		{"request_finished", c.RequestFinished, func(r *pb.EngineRequest, b []*pb.BlockList, rc *pb.RequestColumns, i int) *pb.SchedulerOp {
			return &pb.SchedulerOp{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{
				Request: r, Blocks: b, Computed: at(rc.Computed, i), Status: rc.Status[i]}}}
		}},
		{"after_alloc", c.AfterAlloc, func(r *pb.EngineRequest, b []*pb.BlockList, rc *pb.RequestColumns, i int) *pb.SchedulerOp {
			return &pb.SchedulerOp{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{
				Request: r, Blocks: b, Computed: at(rc.Computed, i), External: at(rc.Count, i)}}}
		}},
		{"prefill", c.Prefill, func(r *pb.EngineRequest, b []*pb.BlockList, rc *pb.RequestColumns, i int) *pb.SchedulerOp {
			return &pb.SchedulerOp{Op: &pb.SchedulerOp_Prefill{Prefill: &pb.PrefillRequest{
				Request: r, Blocks: b, Computed: at(rc.Computed, i), Scheduled: at(rc.Count, i)}}}
		}},
	} {
		rc := kind.rc
		if rc == nil {
			continue
		}
		rows := len(rc.RequestId)
		field := func(f string) string { return "columns." + kind.name + "." + f }
		status := len(rc.Status)
		if kind.name != "request_finished" && status != 0 {
			// Only request_finished rows have a status: one sent for
			// another kind's rows would be ignored.
			return nil, stream.Invalid("%s has %d entries, want none (only request_finished rows have a status)", field("status"), status)
		}
		for _, col := range []struct {
			name string
			n    int
		}{
			{"prompt_tokens", len(rc.PromptTokens)}, {"flags", len(rc.Flags)}, {"transfer_id", len(rc.TransferId)},
			{"remote_engine_id", len(rc.RemoteEngineId)}, {"remote_addr", len(rc.RemoteAddr)},
			{"remote_request_id", len(rc.RemoteRequestId)}, {"remote_tp_size", len(rc.RemoteTpSize)},
			{"remote_pp_size", len(rc.RemotePpSize)}, {"remote_num_tokens", len(rc.RemoteNumTokens)}, {"mode", len(rc.Mode)},
			{"computed", len(rc.Computed)}, {"count", len(rc.Count)}, {"remote_generation", len(rc.RemoteGeneration)},
			{"remote_blocks_expiry_unix_nanos", len(rc.RemoteBlocksExpiryUnixNanos)},
			{"status", status}, {"block_lens", len(rc.BlockLens)}, {"block_ids", len(rc.BlockIds)},
			{"remote_block_lens", len(rc.RemoteBlockLens)}, {"remote_block_starts", len(rc.RemoteBlockStarts)},
			{"remote_block_ids", len(rc.RemoteBlockIds)},
		} {
			if rows == 0 && col.n != 0 {
				// No rows: what the other columns hold would be dropped
				// unseen (a client that forgot request_id).
				return nil, stream.Invalid("%s has %d entries, but request_id none (no rows)", field(col.name), col.n)
			}
			if col.n != rows && col.n != 0 && !blockOrStatus[col.name] { // those are checked below
				return nil, stream.Invalid("%s has %d entries, want %d (one per request_id) or none (the default in every row)",
					field(col.name), col.n, rows)
			}
		}
		if rows == 0 {
			continue
		}
		if kind.name == "request_finished" && status != rows {
			return nil, stream.Invalid("%s has %d entries, want %d (one per request_id)", field("status"), status, rows)
		}
		for i, f := range rc.Flags {
			if f&^(colRemotePrefill|colRemoteDecode|colNoParams) != 0 {
				return nil, stream.Invalid("%s[%d] = %d, want a sum of 1 (do_remote_prefill), 2 (do_remote_decode) and 4 (no params)", field("flags"), i, f)
			}
		}
		if len(rc.BlockLens)%rows != 0 || len(rc.RemoteBlockLens)%rows != 0 || len(rc.RemoteBlockStarts) != len(rc.RemoteBlockLens) {
			return nil, stream.Invalid("%s: block_lens has %d entries, remote_block_lens %d, remote_block_starts %d, want multiples of %d rows (one per row and group)",
				field(""), len(rc.BlockLens), len(rc.RemoteBlockLens), len(rc.RemoteBlockStarts), rows)
		}
		groups, rgroups := len(rc.BlockLens)/rows, len(rc.RemoteBlockLens)/rows
		ids, rids := rc.BlockIds, rc.RemoteBlockIds
		take := func(name string, from *[]int32, n int32) ([]int32, error) {
			if n < 0 || int(n) > len(*from) {
				return nil, stream.Invalid("%s: a list of %d ids, but %d are left", field(name), n, len(*from))
			}
			out := (*from)[:n:n]
			*from = (*from)[n:]
			return out, nil
		}
		for i := range rows {
			var params *pb.TransferParams
			if flags := at(rc.Flags, i); flags&colNoParams == 0 {
				params = &pb.TransferParams{TransferId: at(rc.TransferId, i), DoRemotePrefill: flags&colRemotePrefill != 0,
					DoRemoteDecode: flags&colRemoteDecode != 0, RemoteEngineId: at(rc.RemoteEngineId, i), RemoteAddr: at(rc.RemoteAddr, i),
					RemoteRequestId: at(rc.RemoteRequestId, i), RemoteTpSize: at(rc.RemoteTpSize, i), RemotePpSize: at(rc.RemotePpSize, i),
					RemoteNumTokens: at(rc.RemoteNumTokens, i), Mode: at(rc.Mode, i), RemoteGeneration: at(rc.RemoteGeneration, i),
					RemoteBlocksExpiryUnixNanos: at(rc.RemoteBlocksExpiryUnixNanos, i)}
				hasRemote := false
				for g := range rgroups {
					if rc.RemoteBlockLens[i*rgroups+g] != 0 {
						hasRemote = true
					}
				}
				for g := 0; hasRemote && g < rgroups; g++ {
					l, err := take("remote_block_ids", &rids, rc.RemoteBlockLens[i*rgroups+g])
					if err != nil {
						return nil, err
					}
					params.RemoteBlockIds = append(params.RemoteBlockIds, &pb.Span{Start: rc.RemoteBlockStarts[i*rgroups+g], BlockIds: l})
				}
			}
			blocks := make([]*pb.BlockList, groups)
			for g := range groups {
				l, err := take("block_ids", &ids, rc.BlockLens[i*groups+g])
				if err != nil {
					return nil, err
				}
				blocks[g] = &pb.BlockList{BlockIds: l}
			}
			ops = append(ops, kind.op(&pb.EngineRequest{RequestId: rc.RequestId[i], PromptTokens: at(rc.PromptTokens, i), Params: params}, blocks, rc, i))
		}
		if len(ids) != 0 || len(rids) != 0 {
			return nil, stream.Invalid("%s: %d block ids and %d remote block ids left over after every row", field(""), len(ids), len(rids))
		}
	}
	return ops, nil
}
