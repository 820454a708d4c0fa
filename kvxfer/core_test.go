package kvxfer

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"slices"
	"strings"
	"testing"
)

// coreFiles hold the Worker's core (loopState): the per-rank protocol as a
// state machine. worker.go is its driver.
var coreFiles = []string{"core.go", "engine.go", "grant.go", "liveness.go", "loop.go", "recv.go", "refuse.go", "send.go", "sender.go", "timers.go", "wire.go", "failure.go"}

// The core starts no goroutine, touches no channel, reads no clock and
// calls no backend: its driver (worker.go) does all of that, feeding it
// inputs stamped with their time and carrying out the effects it returns.
func TestCoreIsPure(t *testing.T) {
	fset := token.NewFileSet()
	clock := map[string]bool{"Now": true, "Since": true, "Until": true, "Sleep": true, "After": true, "AfterFunc": true,
		"NewTimer": true, "NewTicker": true, "Tick": true}
	for _, name := range coreFiles {
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			bad := ""
			switch n := n.(type) {
			case *ast.GoStmt:
				bad = "a go statement"
			case *ast.SendStmt, *ast.SelectStmt, *ast.ChanType:
				bad = "a channel"
			case *ast.UnaryExpr:
				if n.Op == token.ARROW {
					bad = "a channel receive"
				}
			case *ast.SelectorExpr:
				if x, ok := n.X.(*ast.Ident); ok && x.Name == "time" && clock[n.Sel.Name] {
					bad = "the clock (time." + n.Sel.Name + ")"
				}
				// The Worker's backend (w.be, st.w.be) and its channels and
				// locks belong to the driver.
				if inner, ok := n.X.(*ast.SelectorExpr); ok && inner.Sel.Name == "w" {
					switch n.Sel.Name {
					case "be", "mu", "ready", "wake", "ctx", "hsWG", "xfers", "preps":
						bad = "the driver's " + n.Sel.Name
					}
				}
			}
			if bad != "" {
				t.Errorf("%s: the core uses %s", fset.Position(n.Pos()), bad)
			}
			return true
		})
	}
}

// The list above names every file that declares the core's methods, and
// the driver declares none.
func TestCoreFilesListed(t *testing.T) {
	fset := token.NewFileSet()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range entries {
		name := de.Name()
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Recv == nil {
				continue
			}
			star, ok := fd.Recv.List[0].Type.(*ast.StarExpr)
			if !ok {
				continue
			}
			if id, ok := star.X.(*ast.Ident); ok && id.Name == "loopState" && !slices.Contains(coreFiles, name) {
				t.Errorf("%s declares the core's method %s but is not in coreFiles", name, fd.Name.Name)
			}
		}
	}
}
