#!/usr/bin/env bash
# Builds llama.cpp's web UI (the SvelteKit page llama-server shows at /) from the same vendored llama.cpp that
# bench/build_llama_server.sh compiles, for bench.bench_page --peer. The source package carries the UI's source but
# not its built files, and llama-server fetches prebuilt ones from Hugging Face at build time, which this machine
# cannot reach; so this builds them with npm (Node >= 20 and the npm registry; about 1.5 minutes on 2 cores, once) and
# llama-server serves them with `--path`. Idempotent: a second run prints the folder's path. REBUILD=1 builds again.
# Usage: bash bench/build_llama_ui.sh  (prints the folder last)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(bash bench/build_llama_server.sh | tail -1)
src=$(dirname "$(dirname "$(dirname "$bin")")")  # <root>/<version>/build/bin/llama-server -> <root>/<version>
ui="$src/vendor/llama.cpp/tools/ui"
out="$src/ui-dist"
if [ ! -f "$out/index.html" ] || [ "${REBUILD:-0}" = 1 ]; then
  command -v npm >/dev/null || { echo "build_llama_ui.sh: npm is needed (Node >= 20)" >&2; exit 1; }
  # the UI's own test tools (Playwright) would download browsers in a postinstall step: not needed to build it
  (cd "$ui" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund >&2)
  # `vite build` alone: `npm run build` first renders the PWA's icons, which the chat page does not use
  (cd "$ui" && LLAMA_UI_OUT_DIR="$out" npx --no-install vite build >&2)
fi
echo "$out"
