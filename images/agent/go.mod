module vmsandbox/agent

go 1.19
