//go:build tools

// Package tools records the upstream command built from this module so that go mod tidy keeps it.
package tools

import (
	_ "sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin"
)
