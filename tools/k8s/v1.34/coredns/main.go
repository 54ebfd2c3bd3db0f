// CoreDNS for the one-node cluster: the stock server (coremain) with only the plugins its Corefile
// uses, in CoreDNS's own order of execution, so that the build leaves out the cloud back-ends.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// the order core/dnsserver/zdirectives.go gives these plugins (a request passes them in this order)
var directives = []string{"bind", "ready", "errors", "log", "cache", "kubernetes", "forward"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
