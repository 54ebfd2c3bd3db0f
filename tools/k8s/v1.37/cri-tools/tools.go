//go:build tools

// critest is a test binary (go test -c sigs.k8s.io/cri-tools/cmd/critest), which a tool directive
// cannot name; these are the packages its test imports, so that go.mod and go.sum hold them.
package tools

import (
	_ "github.com/onsi/ginkgo/v2"
	_ "github.com/onsi/gomega"
	_ "sigs.k8s.io/cri-tools/pkg/benchmark"
	_ "sigs.k8s.io/cri-tools/pkg/common"
	_ "sigs.k8s.io/cri-tools/pkg/framework"
	_ "sigs.k8s.io/cri-tools/pkg/validate"
)
