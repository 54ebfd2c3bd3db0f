"""Generated code only: the CRI's and NRI's protobuf modules, made by scripts/gen-proto.sh from proto/gen/.

Nothing here is edited by hand except the package docstrings."""
