#!/usr/bin/env bash
# The documentation site (mkdocs.yml, pages in docs/): `bash scripts/docs.sh` serves it at http://127.0.0.1:8000
# and rebuilds it as pages change; `bash scripts/docs.sh build` builds it into site/ and fails on any broken
# link, anchor or API reference, as CI does. Needs the dev tools: bash scripts/setup.sh --dev.
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's notice about its successor, printed at every build

# Regenerate the pages that come from the code (configuration and command line) first.
python -m adloco.docs --write

case "${1:-serve}" in
  serve) exec mkdocs serve "${@:2}" ;;
  build) exec mkdocs build --strict "${@:2}" ;;
  *) echo "usage: scripts/docs.sh [serve|build] [mkdocs options]" >&2; exit 2 ;;
esac
