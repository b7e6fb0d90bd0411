#!/usr/bin/env bash
# Build the pinned libggml-python with GGML's Vulkan backend (any desktop GPU vendor, and
# Mesa's software device for CI) into a wheel:
#   vendor/build_ggml_vulkan.sh [OUT_DIR]      -> OUT_DIR/wheels/libggml_python-*.whl
# Then, in the environment that should use it:
#   pip install --force-reinstall OUT_DIR/wheels/libggml_python-*.whl && pip install --force-reinstall --no-deps .
# Needs Debian's glslc, libvulkan-dev and spirv-headers (installed here when missing, as root).
# Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings, which the pinned GGML
# uses: then Debian 13's headers are unpacked into OUT_DIR and given to CMake, and GGML's
# sources stay as they are. About 4 minutes on 2 cores. CMAKE_ARGS are passed on
# (e.g. -DGGML_NATIVE=ON); pip's wheel cache would ignore them, so it is not used.
set -euo pipefail
cd "$(dirname "$0")/.."
. vendor/debian_package.sh
OUT=$(realpath -m "${1:-build/ggml-vulkan}")
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}

missing=()
for package in glslc libvulkan-dev spirv-headers; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

headers=/usr/include
if ! grep -q VkLayerSettingEXT /usr/include/vulkan/vulkan_core.h; then
  if [ ! -f "$OUT/vulkan-headers/usr/include/vulkan/vulkan.hpp" ]; then
    debian_package trixie libvulkan-dev "$OUT/vulkan-headers"
  fi
  headers=$OUT/vulkan-headers/usr/include
fi

sdist_dir=$OUT/sdist
mkdir -p "$sdist_dir"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: libggml-python==0.20.2.post1 -d "$sdist_dir"
USE_VULKAN=1 CMAKE_ARGS="-DVulkan_INCLUDE_DIR=$headers ${CMAKE_ARGS:-}" \
  "$PYTHON" -m pip wheel --no-cache-dir --no-deps -w "$OUT/wheels" "$sdist_dir"/libggml_python-0.20.2.post1.tar.gz
ls "$OUT"/wheels/libggml_python-*.whl
