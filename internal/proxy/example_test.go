package proxy_test

import (
	"fmt"

	"github.com/kvxfer/kvxfer/internal/proxy"
)

func ExampleParsePrefill() {
	p, err := proxy.ParsePrefill("http://10.0.0.1:8100,engine=p0,kv=10.0.0.1:7400,tp=2")
	if err != nil {
		panic(err)
	}
	fmt.Println(p.URL, p.Engine, p.KVHost, p.KVPort, p.TP)
	// Output: http://10.0.0.1:8100 p0 10.0.0.1 7400 2
}
