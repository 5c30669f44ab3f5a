#!/usr/bin/env bash
# Re-fetch the web chat's third-party files into frontend/vendor/ from the npm registry,
# by pinned version: the release files as published (unmodified), with their licenses.
# `npm pack` checks each tarball against the registry's integrity hash. Run from anywhere;
# commit what changes. To upgrade a library, change its version here and re-run.
#
# KaTeX ships each font as woff2, woff and ttf; its CSS lists woff2 first and every browser
# the chat supports reads woff2, so only those are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENDOR=frontend/vendor
PACKAGES=(
  "marked@18.2.1"
  "dompurify@3.4.18"
  "@highlightjs/cdn-assets@11.12.0"
  "katex@0.19.1"
  "marked-katex-extension@5.1.13"
)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

unpack() {  # unpack PACKAGE@VERSION DIR: the package's files under DIR/package
  local tarball
  tarball=$(cd "$work" && npm pack --silent "$1" | tail -n 1)
  mkdir -p "$2"
  tar -xzf "$work/$tarball" -C "$2"
}

rm -rf "$VENDOR"
mkdir -p "$VENDOR"
for spec in "${PACKAGES[@]}"; do
  name=${spec%@*}
  dir="$work/${name//\//_}"
  unpack "$spec" "$dir"
  src="$dir/package"
  case "$name" in
    marked)
      mkdir -p "$VENDOR/marked"
      cp "$src/lib/marked.umd.js" "$src/LICENSE" "$VENDOR/marked/"
      ;;
    dompurify)
      mkdir -p "$VENDOR/dompurify"
      cp "$src/dist/purify.min.js" "$src/LICENSE" "$VENDOR/dompurify/"
      ;;
    @highlightjs/cdn-assets)
      # The "common" build: about 40 popular languages in one file.
      mkdir -p "$VENDOR/highlight.js"
      cp "$src/highlight.min.js" "$src/LICENSE" "$src/styles/github.min.css" \
        "$src/styles/github-dark.min.css" "$VENDOR/highlight.js/"
      ;;
    katex)
      mkdir -p "$VENDOR/katex/fonts"
      cp "$src/dist/katex.min.js" "$src/dist/katex.min.css" "$src/LICENSE" "$VENDOR/katex/"
      cp "$src"/dist/fonts/*.woff2 "$VENDOR/katex/fonts/"
      ;;
    marked-katex-extension)
      mkdir -p "$VENDOR/marked-katex-extension"
      cp "$src/lib/index.umd.js" "$src/LICENSE" "$VENDOR/marked-katex-extension/"
      ;;
  esac
  echo "$spec" >>"$VENDOR/VERSIONS"
done
echo "fetched into $VENDOR:"
cat "$VENDOR/VERSIONS"
