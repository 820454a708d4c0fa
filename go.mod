module github.com/kvxfer/kvxfer

go 1.26

require (
	github.com/puzpuzpuz/xsync/v4 v4.5.0
	golang.org/x/sys v0.34.0
	google.golang.org/grpc v1.76.0
	google.golang.org/protobuf v1.36.10
)

require (
	github.com/klauspost/compress v1.18.0 // indirect
	golang.org/x/net v0.42.0 // indirect
	golang.org/x/text v0.27.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20250804133106-a7a43d27e69b // indirect
)
