package a

import (
	"errors"
	"fmt"
)

type I interface{ Close() error }

type T struct{}

func (*T) Close() error { return nil }

type V struct{}

func (V) Close() error { return nil }

func New() (*T, error)         { return nil, errors.New("did not open") }
func New3() (*T, int, error)   { return nil, 0, errors.New("did not open") }
func NewI() (I, error)         { return nil, errors.New("did not open") }
func NewV() (V, error)         { return V{}, errors.New("did not open") }
func Lookup(string) (*T, bool) { return nil, false }

// Rule 1: return f(...) into an interface result.

func direct() (I, error) {
	return New() // want `New's result 0 \(\*T\) is returned as I: when the call fails it is a nil pointer in a non-nil interface`
}

func three() (I, int, error) {
	return New3() // want `New3's result 0 \(\*T\) is returned as I`
}

func toAny() (any, error) {
	return (New()) // want `New's result 0 \(\*T\) is returned as any`
}

func inLiteral() func() (I, error) {
	return func() (I, error) {
		return New() // want `New's result 0 \(\*T\) is returned as I`
	}
}

// Rule 2: return x, err with x assigned from a call that can fail.

func viaVar() (I, error) {
	t, err := New()
	return t, err // want `t \(\*T, assigned from a call that can fail\) is returned as I beside an error that may be non-nil`
}

func viaWrapped() (I, error) {
	var t, err = New()
	return t, fmt.Errorf("open: %w", err) // want `t \(\*T, assigned from a call that can fail\) is returned as I`
}

func viaAssigned() (i I, err error) {
	var t *T
	t, err = New()
	return t, err // want `t \(\*T, assigned from a call that can fail\) is returned as I`
}

// Rule 3: an interface assigned from a call that can fail.

type holder struct{ i I }

func assigned() error {
	var i I
	var err error
	i, err = New() // want `New's result 0 \(\*T\) is assigned to I: when the call fails it is a nil pointer in a non-nil interface`
	_ = i
	return err
}

func field(h *holder) (err error) {
	h.i, err = New() // want `New's result 0 \(\*T\) is assigned to I`
	return err
}

func redeclared() error {
	var i I
	i, err := New() // want `New's result 0 \(\*T\) is assigned to I`
	_ = i
	return err
}

// Not reported.

func checked() (I, error) {
	t, err := New()
	if err != nil {
		return nil, err
	}
	return t, nil
}

func concrete() (*T, error) {
	return New() // the pointer stays a pointer
}

func sameInterface() (I, error) {
	return NewI() // already an interface: no conversion here
}

func value() (I, error) {
	return NewV() // a value is never nil
}

func noError() (I, bool) {
	return Lookup("x") // no error result: not a call that fails by convention
}

func literal() (I, error) {
	return &T{}, errors.New("half open")
}

func notFallible() (I, error) {
	t := &T{}
	return t, errors.New("x") // t never came from a call that can fail
}

func declared() error {
	t, err := New() // t is a *T: nothing converts it
	_ = t
	return err
}

func blank() error {
	_, err := New()
	return err
}

func noInterfaceResult() (*T, error) {
	t, err := New()
	return t, err
}

func nested() (I, error) {
	open := func() (*T, error) { return New() }
	t, err := open()
	if err != nil {
		return nil, err
	}
	return t, nil
}

// Type parameters are not judged: P may or may not be a pointer.
func generic[P I](open func() (P, error)) (I, error) {
	return open()
}
