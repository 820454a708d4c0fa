// Package typednil defines an Analyzer that finds a nil pointer about to
// become a non-nil interface beside an error: the typed nil that crashed
// kvxferd when a backend failed to open (review issue 23, finding 9).
//
// # The rule
//
// By Go's convention a function that fails returns its error and zero
// values: New returns (*Backend)(nil), err. Converted to an interface, a
// nil *Backend is not a nil interface, so a caller that checks the
// interface against nil (or calls Close on it in a cleanup) is handed a
// value that looks live and dereferences nil. The analyzer reports, in a
// function whose last result is error:
//
//  1. return f(...) where f returns a concrete pointer, ..., error and the
//     pointer lands in an interface result;
//  2. return x, ..., e where x is a pointer variable returned as an
//     interface result, x was assigned in this function from a call that
//     can fail (x, ..., err := g(...), g's last result an error), and e is
//     not the literal nil: x may be nil beside the error.
//
// and, anywhere,
//
//  3. v, ..., err = f(...) where f returns a concrete pointer, ..., error
//     and v is an interface (a variable, a field): v holds the typed nil
//     when f fails.
//
// Generated files (ast.IsGenerated) are not checked: gRPC's handlers
// return a service method's (*Response, error) as (any, error), and gRPC
// reads the error first.
//
// The fix is always to look at the error first: if err != nil { return
// nil, err }; return x, nil. What the rule does not see (flow-insensitive
// and local): pointers that are nil for other reasons, a pointer passed
// on through a helper's own results, and returns whose error cannot be
// non-nil but is not the literal nil (report 2 then asks for the same
// rewrite, which also reads better).
package typednil

import (
	"go/ast"
	"go/token"
	"go/types"

	"golang.org/x/tools/go/analysis"
	"golang.org/x/tools/go/analysis/passes/inspect"
	"golang.org/x/tools/go/ast/inspector"
)

// Analyzer reports typed nils about to reach an interface (see the package
// doc for the rule).
var Analyzer = &analysis.Analyzer{
	Name:     "typednil",
	Doc:      "report nil pointers that become non-nil interfaces beside an error (return New(...) into an interface result)",
	URL:      "https://pkg.go.dev/github.com/kvxfer/kvxfer/internal/lint/typednil",
	Requires: []*analysis.Analyzer{inspect.Analyzer},
	Run:      run,
}

var errorType = types.Universe.Lookup("error").Type()

func run(pass *analysis.Pass) (any, error) {
	generated := map[*token.File]bool{}
	for _, f := range pass.Files {
		if ast.IsGenerated(f) {
			generated[pass.Fset.File(f.Pos())] = true
		}
	}
	ins := pass.ResultOf[inspect.Analyzer].(*inspector.Inspector)
	ins.Preorder([]ast.Node{(*ast.FuncDecl)(nil), (*ast.FuncLit)(nil), (*ast.AssignStmt)(nil)}, func(n ast.Node) {
		if generated[pass.Fset.File(n.Pos())] {
			return
		}
		switch n := n.(type) {
		case *ast.FuncDecl:
			if n.Body != nil {
				if obj, ok := pass.TypesInfo.Defs[n.Name].(*types.Func); ok {
					checkFunc(pass, obj.Type().(*types.Signature), n.Body)
				}
			}
		case *ast.FuncLit:
			if sig, ok := pass.TypesInfo.TypeOf(n).(*types.Signature); ok {
				checkFunc(pass, sig, n.Body)
			}
		case *ast.AssignStmt:
			checkAssign(pass, n)
		}
	})
	return nil, nil
}

// failing returns the results of call when it is a call whose last result
// is an error and which has others (a call that can fail), else nil.
func failing(pass *analysis.Pass, e ast.Expr) *types.Tuple {
	call, ok := ast.Unparen(e).(*ast.CallExpr)
	if !ok {
		return nil
	}
	t, ok := pass.TypesInfo.TypeOf(call).(*types.Tuple)
	if !ok || t.Len() < 2 || !types.Identical(t.At(t.Len()-1).Type(), errorType) {
		return nil
	}
	return t
}

// isPointer: a concrete pointer type (not a type parameter).
func isPointer(t types.Type) bool {
	if _, ok := types.Unalias(t).(*types.TypeParam); ok {
		return false
	}
	_, ok := t.Underlying().(*types.Pointer)
	return ok
}

// isInterface: an interface type (not a type parameter, whose underlying
// type is its constraint).
func isInterface(t types.Type) bool {
	if _, ok := types.Unalias(t).(*types.TypeParam); ok {
		return false
	}
	return types.IsInterface(t)
}

// checkFunc checks the return statements of body, the body of a function
// of signature sig (not those of function literals inside it, checked on
// their own).
func checkFunc(pass *analysis.Pass, sig *types.Signature, body *ast.BlockStmt) {
	res := sig.Results()
	n := res.Len()
	if n < 2 || !types.Identical(res.At(n-1).Type(), errorType) {
		return
	}
	ifaces := false
	for i := range n - 1 {
		ifaces = ifaces || isInterface(res.At(i).Type())
	}
	if !ifaces {
		return
	}
	// Pointer variables assigned from calls that can fail, and the
	// returns, in one walk.
	fallible := map[types.Object]bool{}
	var returns []*ast.ReturnStmt
	ast.Inspect(body, func(node ast.Node) bool {
		switch node := node.(type) {
		case *ast.FuncLit:
			return false
		case *ast.ReturnStmt:
			returns = append(returns, node)
		case *ast.AssignStmt:
			if len(node.Rhs) == 1 {
				markFallible(pass, fallible, node.Lhs, node.Rhs[0])
			}
		case *ast.ValueSpec:
			if len(node.Values) == 1 {
				lhs := make([]ast.Expr, len(node.Names))
				for i, id := range node.Names {
					lhs[i] = id
				}
				markFallible(pass, fallible, lhs, node.Values[0])
			}
		}
		return true
	})
	for _, ret := range returns {
		switch {
		case len(ret.Results) == 1 && n > 1:
			// Rule 1: return f(...).
			t := failing(pass, ret.Results[0])
			if t == nil || t.Len() != n {
				continue
			}
			for i := range n - 1 {
				if isInterface(res.At(i).Type()) && isPointer(t.At(i).Type()) {
					pass.Reportf(ret.Results[0].Pos(), "%s's result %d (%s) is returned as %s: when the call fails it is a nil pointer "+
						"in a non-nil interface beside the error (check the error first and return nil)",
						callName(ret.Results[0]), i, typeString(pass, t.At(i).Type()), typeString(pass, res.At(i).Type()))
					break
				}
			}
		case len(ret.Results) == n:
			// Rule 2: return x, ..., e.
			if isNil(pass, ret.Results[n-1]) {
				continue
			}
			for i := range n - 1 {
				id, ok := ast.Unparen(ret.Results[i]).(*ast.Ident)
				if !ok || !isInterface(res.At(i).Type()) {
					continue
				}
				if obj := pass.TypesInfo.Uses[id]; obj != nil && fallible[obj] && isPointer(obj.Type()) {
					pass.Reportf(id.Pos(), "%s (%s, assigned from a call that can fail) is returned as %s beside an error "+
						"that may be non-nil: a nil pointer in a non-nil interface (return nil when the error is not)",
						id.Name, typeString(pass, obj.Type()), typeString(pass, res.At(i).Type()))
				}
			}
		}
	}
}

// markFallible records the pointer variables of lhs assigned from rhs, a
// call that can fail.
func markFallible(pass *analysis.Pass, fallible map[types.Object]bool, lhs []ast.Expr, rhs ast.Expr) {
	t := failing(pass, rhs)
	if t == nil || t.Len() != len(lhs) {
		return
	}
	for i := range len(lhs) - 1 {
		id, ok := lhs[i].(*ast.Ident)
		if !ok || !isPointer(t.At(i).Type()) {
			continue
		}
		obj := pass.TypesInfo.Defs[id]
		if obj == nil {
			obj = pass.TypesInfo.Uses[id]
		}
		if obj != nil {
			fallible[obj] = true
		}
	}
}

// checkAssign is rule 3: v, ..., err = f(...) with v an interface.
func checkAssign(pass *analysis.Pass, as *ast.AssignStmt) {
	if len(as.Rhs) != 1 {
		return
	}
	t := failing(pass, as.Rhs[0])
	if t == nil || t.Len() != len(as.Lhs) {
		return
	}
	for i := range len(as.Lhs) - 1 {
		lhs := as.Lhs[i]
		if id, ok := lhs.(*ast.Ident); ok && (id.Name == "_" || pass.TypesInfo.Defs[id] != nil) {
			continue // blank, or declared here with the call's own type
		}
		lt := pass.TypesInfo.TypeOf(lhs)
		if lt != nil && isInterface(lt) && isPointer(t.At(i).Type()) {
			pass.Reportf(lhs.Pos(), "%s's result %d (%s) is assigned to %s: when the call fails it is a nil pointer in a non-nil interface "+
				"(assign it to a variable of its own type and check the error first)",
				callName(as.Rhs[0]), i, typeString(pass, t.At(i).Type()), typeString(pass, lt))
		}
	}
}

func isNil(pass *analysis.Pass, e ast.Expr) bool {
	tv, ok := pass.TypesInfo.Types[ast.Unparen(e)]
	return ok && tv.IsNil()
}

func callName(e ast.Expr) string {
	call := ast.Unparen(e).(*ast.CallExpr)
	switch f := ast.Unparen(call.Fun).(type) {
	case *ast.Ident:
		return f.Name
	case *ast.SelectorExpr:
		if x, ok := f.X.(*ast.Ident); ok {
			return x.Name + "." + f.Sel.Name
		}
		return f.Sel.Name
	}
	return "the call"
}

// typeString names t's packages by name (server.Backend), this one's not
// at all.
func typeString(pass *analysis.Pass, t types.Type) string {
	return types.TypeString(t, func(p *types.Package) string {
		if p == pass.Pkg {
			return ""
		}
		return p.Name()
	})
}
