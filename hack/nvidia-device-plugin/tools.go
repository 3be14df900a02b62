//go:build tools

// Package tools records the upstream command built from this module so that go mod tidy keeps it.
package tools

import (
	_ "github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin"
)
