module vmsandbox/agent

go 1.19

require github.com/santhosh-tekuri/jsonschema/v5 v5.3.1
