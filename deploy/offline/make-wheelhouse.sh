#!/usr/bin/env bash
# Make a wheelhouse for offline image builds: every wheel an image installs (layerswarm's runtime
# dependencies from pyproject.toml, plus the extras named in EXTRAS, torch at constraints.txt's pin, the
# build backend), nothing else: no dev or training extras.
#
#   deploy/offline/make-wheelhouse.sh .wheelhouse          # CPU image (EXTRAS=coordinator: torch, HTTP)
#   EXTRAS='' deploy/offline/make-wheelhouse.sh .wheelhouse-node                   # the lean node image
#   EXTRAS='' ARCH=aarch64 deploy/offline/make-wheelhouse.sh .wheelhouse-node-aarch64   # ... for arm64
#   EXTRAS='' ARCH=aarch64 PYTHON_VERSION=3.10 deploy/offline/make-wheelhouse.sh .wheelhouse-jetson
#                                                          # Jetson (JetPack 6): torch is the base image's
#   docker build ... --build-arg WHEELHOUSE=.wheelhouse    # the directory must be inside the build context
#
# pip uses its usual configuration (index, --find-links), so a local torch wheel or a PyPI mirror is
# found the same way as by `pip install`. Only binary wheels are taken: nothing compiles at build time,
# and a requirement without a wheel for the target fails here, not on the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-.wheelhouse}"
arch="${ARCH:-x86_64}"
py="${PYTHON_VERSION:-3.11}"
with_torch="${TORCH:-yes}"
extras="${EXTRAS-coordinator}"
mkdir -p "$out"
reqfile="$(mktemp)"
trap 'rm -f "$reqfile"' EXIT
# Runtime requirements straight from pyproject.toml, so the wheelhouse cannot drift from it.
python3 - "$with_torch" "$extras" >"$reqfile" <<'PY'
import re, sys, tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
keep_torch, wanted = sys.argv[1] == "yes", [e for e in sys.argv[2].split(",") if e]
deps, seen = list(project["dependencies"]), set()
while wanted:  # an extra may name others of this project (coordinator -> torch)
    extra = wanted.pop()
    if extra in seen:
        continue
    seen.add(extra)
    for dep in project["optional-dependencies"][extra]:
        inner = re.fullmatch(r"layerswarm\[(.+)\]", dep)
        if inner:
            wanted.extend(inner.group(1).split(","))
        else:
            deps.append(dep)
print("\n".join(d for d in deps if keep_torch or not d.startswith("torch")))
print("setuptools>=69\nwheel\npip")
PY
# pip wants every accepted platform tag named: manylinux_2_28 down to the oldest.
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1 linux; do
  platforms+=(--platform "${tag}_${arch}")
done
python3 -m pip download -q --dest "$out" --only-binary=:all: --python-version "$py" "${platforms[@]}" \
  -c constraints.txt -r "$reqfile" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "make-wheelhouse: $(find "$out" -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
