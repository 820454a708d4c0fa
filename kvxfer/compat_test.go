package kvxfer

import "testing"

// SPEC §12 connector tests 33-39: what changes the hash and what does not.
func TestCompatHash(t *testing.T) {
	base := CompatFactors{EngineVersion: "0.11", Model: "llama-70b", Dtype: "bf16", NumKVHeads: 8, HeadSize: 128, NumHiddenLayers: 80,
		AttnBackend: "FLASH_ATTN", CacheDtype: "auto", Mode: ModePull}
	h := CompatHash(base)
	if h != CompatHash(base) || len(h) != 64 {
		t.Fatalf("CompatHash is not a stable hex SHA-256: %q", h)
	}
	changes := map[string]func(*CompatFactors){
		"engine version": func(f *CompatFactors) { f.EngineVersion = "0.12" },
		"model":          func(f *CompatFactors) { f.Model = "llama-8b" },
		"dtype":          func(f *CompatFactors) { f.Dtype = "fp16" },
		"cache dtype":    func(f *CompatFactors) { f.CacheDtype = "fp8" },
		"kv heads":       func(f *CompatFactors) { f.NumKVHeads = 16 },
		"head size":      func(f *CompatFactors) { f.HeadSize = 64 },
		"layers":         func(f *CompatFactors) { f.NumHiddenLayers = 40 },
		"backend":        func(f *CompatFactors) { f.AttnBackend = "TRITON_ATTN" },
		"hybrid":         func(f *CompatFactors) { f.HybridKVCache = true },
		"transfer mode":  func(f *CompatFactors) { f.Mode = ModePush },
		"speculative":    func(f *CompatFactors) { f.Speculative = &SpecConfig{Method: "eagle3", DraftModel: "d"} },
		"spec parallel": func(f *CompatFactors) {
			f.Speculative = &SpecConfig{Method: "eagle3", DraftModel: "d", ParallelDrafting: true}
		},
	}
	seen := map[string]string{h: "base"}
	for name, change := range changes {
		f := base
		change(&f)
		got := CompatHash(f)
		if other, dup := seen[got]; dup {
			t.Errorf("changing %s gives the hash of %s", name, other)
		}
		seen[got] = name
	}
}
