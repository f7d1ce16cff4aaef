#!/usr/bin/env bash
# Make the hashed locks again from pyproject.toml (see requirements/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "pip-tools>=7.4,<8"
compile() {  # OUT, then pip-compile's inputs and options
  local out=$1; shift
  pip-compile -q --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links --output-file "$out" "$@"
  # the project itself is installed from the checkout (pip install -e .), not from the lock
  python - "$out" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
text = re.sub(r"# WARNING: pip install will require the following package to be hashed\.\n# Consider using[^\n]*\n"
              r"taskloop @ [^\n]*\n(?:    #[^\n]*\n)*", "", text)
text = text.replace("pyproject.toml requirements/.image.in", "pyproject.toml (the ui extra) with flower")
open(path, "w").write(text)
PY
}
printf 'flower>=2.2,<3\n' > requirements/.image.in
compile requirements/image.txt --extra ui pyproject.toml requirements/.image.in
compile requirements/dev.txt --extra dev pyproject.toml
rm requirements/.image.in
