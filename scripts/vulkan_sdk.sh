#!/usr/bin/env bash
# Vulkan headers new enough for ggml-vulkan at the pin (>= 1.3.261: vk::LayerSettingEXT) on a
# system whose own are older (Debian 12 ships 1.3.239).
#   - libvulkan-dev and spirv-headers come from Debian trixie's archive through `apt-get download`
#     with a private apt state (nothing is added to the system's sources or installed); the .debs
#     are only unpacked (dpkg-deb -x) into a cached prefix. Headers are architecture-independent.
#   - glslc is trixie's too (2025.2): Debian 12's 2023.2 lacks GL_KHR_cooperative_matrix,
#     GL_NV_cooperative_matrix2 and GL_EXT_integer_dot_product, and ggml-vulkan silently builds
#     without those shaders. Trixie's binary needs glibc 2.38, so it runs through trixie's own
#     dynamic loader and libraries, unpacked beside it (bin/glslc is that wrapper).
#   - The loader (libvulkan.so.1) is the system's: its ABI is stable and the wheel must not ship
#     one. Debian/Ubuntu: apt-get install libvulkan1. Overrides: VULKAN_GLSLC, VULKAN_LIBRARY.
# Usage: scripts/vulkan_sdk.sh [OUT_DIR]
#   default OUT_DIR: ${LLAMACRAB_CACHE_DIR:-~/.cache/llamacrab}/vulkan-sdk/<versions>
#   VULKAN_SDK_APT_LISTS=DIR reuses already fetched trixie apt lists instead of `apt-get update`.
# Prints one line of CMake arguments on stdout, e.g.
#   LLAMACRAB_BACKEND=vulkan LLAMACRAB_CMAKE_ARGS="$(scripts/vulkan_sdk.sh)" pip wheel ./llamacrab-sys
set -euo pipefail

suite=trixie
packages=(libvulkan-dev=1.4.309.0-1 spirv-headers=1.6.1+1.4.309.0-1
    glslc=2025.2-1 libshaderc1=2025.2-1 libc6 libstdc++6 libgcc-s1)
minimum=1.3.261
keyring=${VULKAN_SDK_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}

out=${1:-${LLAMACRAB_CACHE_DIR:-$HOME/.cache/llamacrab}/vulkan-sdk/vulkan-1.4.309.0-glslc-2025.2}
die() { echo "vulkan_sdk.sh: $*" >&2; exit 1; }

fetch() {
    local apt="$out/apt" lists=${VULKAN_SDK_APT_LISTS:-$out/apt/lists}
    [ -r "$keyring" ] || die "no Debian archive keyring at $keyring (install debian-archive-keyring)"
    mkdir -p "$apt/debs" "$apt/cache" "$lists/partial"
    echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite main" >"$apt/sources.list"
    # Private sources, lists and caches: the system's apt state is neither read nor changed.
    local opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o Dir::Etc::sourceparts=/dev/null
        -o "Dir::State::Lists=$lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root)
    if ! compgen -G "$lists/*_Packages*" >/dev/null; then
        apt-get "${opts[@]}" update >&2
    fi
    (cd "$apt/debs" && apt-get "${opts[@]}" download "${packages[@]}" >&2)
    rm -rf "$out/root"
    for deb in "$apt/debs"/*.deb; do
        dpkg-deb -x "$deb" "$out/root"
    done
    local loader libs
    loader=$(compgen -G "$out/root/usr/lib/*/ld-linux*.so.*" | head -n1)
    [ -n "$loader" ] || die "no dynamic loader unpacked from libc6"
    libs=$(dirname "$loader")
    mkdir -p "$out/bin"
    printf '#!/bin/sh\nexec %q --library-path %q %q "$@"\n' \
        "$loader" "$libs" "$out/root/usr/bin/glslc" >"$out/bin/glslc"
    chmod +x "$out/bin/glslc"
    touch "$out/.complete"
}

[ -e "$out/.complete" ] || fetch
include="$out/root/usr/include"
spirv_dir="$out/root/usr/share/cmake/SPIRV-Headers"
core="$include/vulkan/vulkan_core.h"
[ -f "$core" ] || die "no $core: remove $out and run again"
[ -f "$spirv_dir/SPIRV-HeadersConfig.cmake" ] || die "no SPIRV-HeadersConfig.cmake in $spirv_dir"

# VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION) -> 1.4.<patch>
patch=$(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/\1/p' "$core")
major_minor=$(sed -n 's/^#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, *\([0-9]*\), *\([0-9]*\),.*/\1.\2/p' "$core")
version="$major_minor.$patch"
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "cannot read the header version from $core"
oldest=$(printf '%s\n%s\n' "$minimum" "$version" | sort -V | head -n1)
[ "$oldest" = "$minimum" ] || die "Vulkan headers $version in $include are older than $minimum"

glslc=${VULKAN_GLSLC:-$out/bin/glslc}
"$glslc" --version >/dev/null || die "$glslc does not run"
# The compiler's own search finds the loader for the target architecture.
library=${VULKAN_LIBRARY:-$(realpath -s "$(${CC:-cc} -print-file-name=libvulkan.so.1)")}
[ -f "$library" ] || die "no libvulkan.so.1 found (apt-get install libvulkan1, or set VULKAN_LIBRARY)"

echo "Vulkan headers $version in $include" >&2
echo "-DVulkan_INCLUDE_DIR=$include -DVulkan_LIBRARY=$library -DVulkan_GLSLC_EXECUTABLE=$glslc" \
    "-DSPIRV-Headers_DIR=$spirv_dir"
