package kvxfer

import (
	"go/ast"
	"go/parser"
	"go/token"
	"log/slog"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// coreFiles hold the Worker's core (loopState): the per-rank protocol as a
// state machine. worker.go is its driver.
var coreFiles = []string{"core.go", "engine.go", "grant.go", "liveness.go", "loop.go", "recv.go", "refuse.go", "send.go", "sender.go", "timers.go", "wire.go", "failure.go", "await.go", "holdcheck.go", "released.go"}

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
			}
			if bad != "" {
				t.Errorf("%s: the core uses %s", fset.Position(n.Pos()), bad)
			}
			return true
		})
	}
}

// The core cannot reach its driver, a backend or shared state: no value
// of its type leads to a Worker, a Backend, a Resolver, the grant table,
// a channel, a lock, a context or a function (which could be any of
// them) — checked over the type itself, so a field added for one fails
// here, and code in the core that names one does not compile (it has no
// path to it). What it may reach beyond its own state: its Metrics
// (counters it only adds to) and its logger.
func TestCoreReachesNothingShared(t *testing.T) {
	allowed := map[reflect.Type]string{
		reflect.TypeFor[*Metrics]():       "counters the core adds to",
		reflect.TypeFor[*slog.Logger]():   "the log",
		reflect.TypeFor[error]():          "an error value",
		reflect.TypeFor[time.Time]():      "a time value (its zone pointer is read-only)",
		reflect.TypeFor[*time.Location](): "a time value's zone",
	}
	denied := map[reflect.Type]string{
		reflect.TypeFor[*Worker]():      "the driver",
		reflect.TypeFor[*accessTable](): "the grant table (shared with the backend's goroutines)",
	}
	seen := map[reflect.Type]bool{}
	var walk func(t0 reflect.Type, path string)
	walk = func(t0 reflect.Type, path string) {
		if seen[t0] {
			return
		}
		seen[t0] = true
		if why, ok := denied[t0]; ok {
			t.Errorf("the core reaches %s through %s (%v)", why, path, t0)
			return
		}
		if _, ok := allowed[t0]; ok {
			return
		}
		if t0.PkgPath() == "sync" || t0.PkgPath() == "sync/atomic" || t0.PkgPath() == "context" {
			t.Errorf("the core holds %v through %s: shared state", t0, path)
			return
		}
		switch t0.Kind() {
		case reflect.Chan:
			t.Errorf("the core holds a channel through %s", path)
		case reflect.Func:
			t.Errorf("the core holds a function through %s (%v): it could reach anything", path, t0)
		case reflect.Interface:
			t.Errorf("the core holds an interface through %s (%v): it could be a backend or a resolver", path, t0)
		case reflect.UnsafePointer:
			t.Errorf("the core holds an unsafe pointer through %s", path)
		case reflect.Pointer, reflect.Slice, reflect.Array:
			walk(t0.Elem(), path+"[]")
		case reflect.Map:
			walk(t0.Key(), path+"{key}")
			walk(t0.Elem(), path+"{}")
		case reflect.Struct:
			for i := range t0.NumField() {
				f := t0.Field(i)
				walk(f.Type, path+"."+f.Name)
			}
		}
	}
	walk(reflect.TypeFor[loopState](), "loopState")
	if !seen[reflect.TypeFor[*Metrics]()] {
		t.Error("the walk never met the core's Metrics: it is broken")
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
