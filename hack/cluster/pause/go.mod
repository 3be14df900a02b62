// The pod sandbox process of the e2e cluster (see main.go); built by ../build.sh beside each Kubernetes release.
module kxpu.local/hack/cluster/pause

go 1.24.0
