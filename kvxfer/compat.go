package kvxfer

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
)

// Version is kvxfer's connector version, a factor of the compatibility
// hash (the reference's nixl_connector_version).
const Version = "kvxfer/1"

// SpecConfig is the speculative-decoding part of the compatibility
// factors (EAGLE-family drafts share the target's KV transfer).
type SpecConfig struct {
	Method           string `json:"method"`
	DraftModel       string `json:"draft_model"`
	Revision         string `json:"revision"`
	CodeRevision     string `json:"code_revision"`
	ParallelDrafting bool   `json:"parallel_drafting"`
	KVCacheDtype     string `json:"kv_cache_dtype"`
	AuxLayerIDs      []int  `json:"aux_layer_ids"`
}

// CompatFactors are what two engines must agree on to exchange KV (SPEC
// §2). TP size, block size and KV layout are deliberately not factors:
// kvxfer maps between them.
type CompatFactors struct {
	EngineVersion     string      `json:"engine_version"`
	Model             string      `json:"model"`
	Dtype             string      `json:"dtype"`
	NumKVHeads        int         `json:"num_kv_heads"`
	HeadSize          int         `json:"head_size"`
	NumHiddenLayers   int         `json:"num_hidden_layers"`
	AttnBackend       string      `json:"attn_backend_name"`
	CacheDtype        string      `json:"cache_dtype"`
	CrossLayersBlocks bool        `json:"cross_layers_blocks"`
	HybridKVCache     bool        `json:"is_hma_enabled"`
	Speculative       *SpecConfig `json:"speculative_config"`
	Mode              Mode        `json:"-"`
}

// CompatHash returns the hex SHA-256 of the factors, with kvxfer's
// version and the transfer mode, as canonical JSON (sorted keys). Two
// engines handshake only when their hashes are equal.
func CompatHash(f CompatFactors) string {
	m := map[string]any{}
	b, _ := json.Marshal(f)
	_ = json.Unmarshal(b, &m) // map keys marshal sorted
	m["connector_version"] = Version
	m["transfer_mode"] = f.Mode.String()
	b, _ = json.Marshal(m)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}
