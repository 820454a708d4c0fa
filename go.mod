module github.com/kvxfer/kvxfer

go 1.26

require github.com/puzpuzpuz/xsync/v4 v4.5.0
