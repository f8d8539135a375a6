#!/usr/bin/env bash
# Installs what building and running cellgraph needs beyond a Rust toolchain, if missing:
# OpenMPI (mpirun and its headers, for the `mpi` crate), libclang (for its bindings),
# Graphviz (`cellgraph inspect render`), and the Vulkan loader with Mesa's drivers, whose
# lavapipe runs the `wgpu` device tests on a CPU.
set -euo pipefail
missing=()
for pkg in openmpi-bin libopenmpi-dev libclang-dev graphviz libvulkan1 mesa-vulkan-drivers; do
    # "install ok installed" only: a removed package can leave its config files behind.
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing ${missing[*]}" >&2
if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
elif command -v sudo >/dev/null; then
    sudo apt-get update -qq
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
else
    echo "error: cellgraph needs ${missing[*]}; install them (apt-get install ${missing[*]}) and re-run" >&2
    exit 1
fi
