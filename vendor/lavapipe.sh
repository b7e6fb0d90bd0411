#!/usr/bin/env bash
# Mesa's software Vulkan device (lavapipe) for the device tests, in a private directory:
#   eval "$(vendor/lavapipe.sh DIR)"
# prints the environment that makes GGML list it as Vulkan0. Mesa 25.0 from
# bookworm-backports: Debian 12's own lavapipe (Mesa 22.3) corrupts its heap inside its
# execution thread on the engine's scheduler checks (measured: 3 of 3 runs), 25.0 ran
# them all. Nothing is installed system-wide; the loader (libvulkan1) must be present.
set -euo pipefail
cd "$(dirname "$0")/.."
. vendor/debian_package.sh
DIR=$(realpath -m "${1:-build/lavapipe}")
MESA=mesa-vulkan-drivers=25.0.7-2~bpo12+1
lib=$DIR/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so
if [ ! -f "$lib" ]; then
  dpkg -s libvulkan1 >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libvulkan1 >&2; }
  debian_package bookworm-backports "$MESA" "$DIR" >&2
fi
cat > "$DIR/lvp_icd.json" <<JSON
{"file_format_version": "1.0.0", "ICD": {"library_path": "$lib", "api_version": "1.4.305"}}
JSON
mkdir -p "$DIR/shader-cache"
# GGML skips CPU-type Vulkan devices unless told which to use.
echo "export VK_ICD_FILENAMES=$DIR/lvp_icd.json GGML_VK_VISIBLE_DEVICES=0 MESA_SHADER_CACHE_DIR=$DIR/shader-cache"
