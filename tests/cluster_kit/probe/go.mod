// The cluster test's probe: a static program put into its pods' image (no dependencies)
module vmsandbox/tests/cluster_kit/probe

go 1.26.0
