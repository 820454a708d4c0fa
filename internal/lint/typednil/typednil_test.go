package typednil_test

import (
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/kvxfer/kvxfer/internal/lint/typednil"
)

// testdata/src/a holds every rule's cases, reported (// want) and not.
func TestAnalyzer(t *testing.T) {
	analysistest.Run(t, analysistest.TestData(), typednil.Analyzer, "a")
}
