#!/usr/bin/env bash
# On a machine with network access: fetch and strip the NIXL EP and flashinfer parts of the
# offline kit that scripts/gpu/nixl_ep.sh, scripts/gpu/flashinfer.sh and ep_matrix.sh set up on a
# GPU host without network access, into DEST (default: <this checkout>/.gpu17, git-ignored
# through .git/info/exclude). The scripts read the kit relative to the checkout they run in: copy
# the checkout with .gpu17/ to the GPU host (or pass that checkout's .gpu17 as DEST).
#
#   DEST/nixl/       (nixl_ep.sh, ~14 MB) nixl_min.tgz: the nixl-cu13 1.5.1 wheel without what
#                    nixl_ep's build and one-rank run do not load (the three prebuilt nixl_ep .so
#                    for torch 2.12-2.14, the storage/telemetry plugins and their aws/azure libs,
#                    UCX perftest); nixl_ep_src.tgz: nixl's examples/device/ep/csrc and the nixl
#                    headers it includes; ucx_headers.tgz: UCX v1.22.x headers (the device API).
#   DEST/flashinfer/ (flashinfer.sh) the flashinfer-python wheels of FI_VERSIONS (default
#                    "0.7.2.post1 0.7.4", ~21 and ~24 MB) re-zipped without the parts their
#                    two-sided all-to-all never loads (listed in scripts/gpu/flashinfer.sh), plus
#                    the wheels `import flashinfer` needs that a plain torch environment lacks
#                    (~31 MB, the same for both; FI_VERSION picks the version on the GPU host).
#
# Usage: scripts/gpu/prepare17.sh NIXL_GIT_DIR UCX_GIT_DIR [DEST]
#   NIXL_GIT_DIR: a clone of ai-dynamo/nixl (a bare clone will do)
#   UCX_GIT_DIR:  a clone of openucx/ucx
set -euo pipefail
cd "$(dirname "$0")/../.."
NIXL_GIT=${1:?usage: prepare17.sh NIXL_GIT_DIR UCX_GIT_DIR [DEST]}
UCX_GIT=${2:?usage: prepare17.sh NIXL_GIT_DIR UCX_GIT_DIR [DEST]}
DEST=$(realpath -m "${3:-$PWD/.gpu17}")
# The default source revision of nixl_ep: main at 8770b655a (2026-08-21), whose nixl_ep/*.py differ
# from the 1.5.1 wheel's only in one docstring (NIXL_REV=v1.5.1 where your clone has the tag).
# The wheel's Python files are the ones installed; the C++/CUDA sources come from this commit.
NIXL_REV=${NIXL_REV:-8770b655a}
# The wheel's libucp says revision 65e342a, on UCX's v1.22.x line (UCX_REV=65e342a if you have it).
UCX_REV=${UCX_REV:-v1.22.x}
WHEEL=nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
FI_VERSIONS=${FI_VERSIONS:-0.7.2.post1 0.7.4}
PY=${PYTHON:-python3}

exclude_dest() {  # git-ignore DEST in the checkout that holds it
  local top rel
  top=$(git -C "$(dirname "$DEST")" rev-parse --show-toplevel 2>/dev/null) || return 0
  rel=/${DEST#"$top"/}/
  local ex
  ex=$(git -C "$top" rev-parse --git-path info/exclude)
  case $ex in /*) ;; *) ex=$top/$ex ;; esac
  grep -qxF "$rel" "$ex" 2>/dev/null || echo "$rel" >> "$ex"
}
exclude_dest
mkdir -p "$DEST/dl" "$DEST/nixl" "$DEST/flashinfer"

# ---- nixl_ep.sh: nixl_ep ---------------------------------------------------------------------
[ -f "$DEST/dl/$WHEEL" ] || $PY -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$DEST/dl" nixl-cu13==1.5.1
$PY - "$DEST/dl/$WHEEL" "$DEST/nixl/nixl_min.tgz" <<'PY'
"""Keep the wheel's files that libnixl.so, its UCX plugin and UCX itself need (ELF NEEDED
closure inside the wheel), UCX's transport modules, and the nixl_ep Python files."""
import io, re, sys, tarfile, zipfile

whl, out = sys.argv[1:3]
z = zipfile.ZipFile(whl)
names = z.namelist()
by_base = {n.rsplit("/", 1)[-1]: n for n in names if ".so" in n}

def needed(name):
    data = z.read(name)
    # NEEDED entries are in .dynstr; a cheap scan of the strings that look like sonames suffices
    return {m.decode() for m in re.findall(rb"(lib[\w.+-]+\.so[\w.]*)\x00", data)}

roots = [".nixl_cu13.mesonpy.libs/libnixl.so", ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so"]
roots += [n for n in names if n.startswith("nixl_cu13.libs/ucx/") and n.endswith(".so.0.0.0")
          and "perftest" not in n]
keep, todo = set(), list(roots)
while todo:
    n = todo.pop()
    if n in keep:
        continue
    keep.add(n)
    todo += [by_base[b] for b in needed(n) if b in by_base and by_base[b] not in keep]
keep |= {n for n in names if n.startswith("nixl_ep_cu13/") and n.endswith(".py")}
# the dist-info's licences and METADATA (which names the version a run records)
keep |= {n for n in names if n.startswith("nixl_cu13-1.5.1.dist-info/licenses/")
         or n == "nixl_cu13-1.5.1.dist-info/METADATA"}
with tarfile.open(out, "w:gz") as t:
    for n in sorted(keep):
        info = tarfile.TarInfo(n)
        data = z.read(n)
        info.size, info.mode = len(data), 0o755 if ".so" in n else 0o644
        t.addfile(info, io.BytesIO(data))
print(f"nixl_min.tgz: {len(keep)} of {len(names)} wheel files")
PY
git -C "$NIXL_GIT" archive --format=tar.gz --prefix=nixl/ -o "$DEST/nixl/nixl_ep_src.tgz" "$NIXL_REV" \
  examples/device/ep/csrc examples/device/ep/meson.build examples/device/ep/LICENSE-DeepEP \
  src/api/cpp src/api/gpu src/infra src/core LICENSE
# Headers only, plus the two generated version headers (configure would write them).
UCX_TMP=$(mktemp -d)
git -C "$UCX_GIT" archive --format=tar "$UCX_REV" src | tar -x -C "$UCX_TMP" --wildcards \
  '*.h' '*.cuh' '*.inl' 'src/ucp/api/ucp_version.h.in' 'src/uct/api/version.h.in'
UCX_VER=$(git -C "$UCX_GIT" show "$UCX_REV":configure.ac | sed -n 's/^define(\[ucx_ver_\(major\|minor\|patch\)\], *\([0-9]*\)).*/\2/p' | tr '\n' ' ')
read -r MAJ MIN PAT <<<"$UCX_VER"
for f in src/ucp/api/ucp_version.h src/uct/api/version.h; do
  sed -e "s/@MAJOR_VERSION@/$MAJ/g; s/@MINOR_VERSION@/$MIN/g; s/@PATCH_VERSION@/$PAT/g" \
      -e "s/@EXTRA_VERSION@//g; s/@VERSION@/$MAJ.$MIN.$PAT/g; s/@SCM_VERSION@/$UCX_REV/g" \
      -e "s/@SCM_BRANCH@/$UCX_REV/g" \
      "$UCX_TMP/$f.in" > "$UCX_TMP/$f"
done
tar -czf "$DEST/nixl/ucx_headers.tgz" -C "$UCX_TMP" --transform 's,^src,ucx,' src
rm -rf "$UCX_TMP"
echo "UCX headers from $UCX_REV ($(git -C "$UCX_GIT" rev-parse --short "$UCX_REV"), version $MAJ.$MIN.$PAT)"

# ---- flashinfer.sh: flashinfer ---------------------------------------------------------------
for v in $FI_VERSIONS; do
  FI_WHEEL=flashinfer_python-$v-py3-none-any.whl
  [ -f "$DEST/dl/$FI_WHEEL" ] || $PY -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 --platform any -d "$DEST/dl" \
    "flashinfer-python==$v"
  bash scripts/gpu/flashinfer.sh --strip "$DEST/dl/$FI_WHEEL" "$DEST/flashinfer"
done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DEST/flashinfer" -r <(bash scripts/gpu/flashinfer.sh --deps)
du -sh "$DEST/nixl" "$DEST/flashinfer"
du -sh "$DEST/nixl"/* "$DEST/flashinfer"/*
