// Command kvxferlint runs kvxfer's own analyzers (typednil) over packages,
// the way go vet runs its own: .ci/run's lint section runs
//
//	go run ./internal/lint/cmd/kvxferlint ./...
//
// and fails on any report.
package main

import (
	"golang.org/x/tools/go/analysis/singlechecker"

	"github.com/kvxfer/kvxfer/internal/lint/typednil"
)

func main() { singlechecker.Main(typednil.Analyzer) }
