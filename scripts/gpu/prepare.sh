#!/usr/bin/env bash
# On a machine with network access: assemble the offline kit that scripts/gpu/h200.sh (and
# run_all.sh, ep_matrix.sh half A, serve_attempt.sh) set up on a GPU host without it, into .gpu/
# (git-ignored; about 41 MB and 12 MB per vLLM release): the Python files of every vLLM release checked (scripts/vllm_versions.py), the 46 wheels its MoE modules import
# (for Python 3.12, manylinux x86_64), the wheels its API server imports, and DeepEP's V1 source
# (commit 567632d) from a local clone given as $1. Copy the checkout with .gpu/ to the GPU host.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu
# VLLM_VERSIONS: the vLLM releases whose Python goes into the kit (.gpu/vllm_py-<version>.tgz);
# the GPU scripts take one of them by VLLM_VERSION (default: the newest). Default: every release
# of moe_plugins/stack/versions.py's VLLM_CHECKED.
for v in ${VLLM_VERSIONS:-$(python3 scripts/vllm_versions.py checked)}; do
  [ -f ".gpu/vllm_py-$v.tgz" ] && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
    --python-version 3.12 -d .gpu/dl "vllm==$v"
  rm -rf .gpu/vsrc
  python3 - "$v" <<'PY'
import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(f".gpu/dl/vllm-{sys.argv[1]}-*.whl")[0])
for n in z.namelist():
    if n.endswith((".py", ".json")):
        z.extract(n, ".gpu/vsrc")
PY
  tar -czf ".gpu/vllm_py-$v.tgz" -C .gpu/vsrc vllm
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform any -d .gpu/whl \
  annotated-doc==0.0.7 annotated-types==0.8.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 \
  compressed-tensors==0.17.0 dill==0.4.1 distro==1.9.0 dnspython==2.9.2 email-validator==2.4.0 \
  fastapi==0.165.0 googleapis-common-protos==1.76.0 httpcore2==2.16.2 httpx2==2.16.2 ijson==3.6.0 \
  jiter==0.19.0 lark==1.2.2 llguidance==1.7.6 mistral-common==1.13.1 msgspec==0.23.0 openai==3.57.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1 \
  oss-harmony==0.0.11 outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 python-json-logger==4.2.0 \
  python-multipart==0.0.34 pyzmq==27.3.0 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 \
  truststore==0.10.5 typing-inspection==0.4.5 xgrammar==0.2.8
# For scripts/gpu/serve_attempt.sh: what vLLM's API server imports beyond the MoE modules
# (uvicorn, uvloop, aiohttp, ...), 14 MB.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .gpu/whl_serve \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 anthropic==2.15.0 anyio==4.16.0 \
  astor==0.8.1 blake3==1.0.11 click==8.5.1 cloudpickle==3.1.3 depyf==0.20.0 \
  docstring_parser==0.18.0 einops==0.8.2 frozenlist==1.8.0 h11==0.16.0 httpcore==1.0.9 \
  httptools==0.9.0 httpx==0.28.1 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 \
  lm_format_enforcer==0.11.3 mcp==2.3.0 model_hosting_container_standards==0.1.16 \
  multidict==7.2.1 orjson==3.13.0 prometheus_client==0.26.0 \
  prometheus_fastapi_instrumentator==8.1.0 propcache==0.5.4 py_cpuinfo==9.0.0 \
  referencing==0.37.0 rpds_py==2026.9.1 uvicorn==0.54.0 uvloop==0.23.0 watchfiles==1.3.0 \
  yarl==1.25.1
if [ ! -f .gpu/deepep-567632d.tgz ]; then
  git -C "${1:?usage: prepare.sh PATH_TO_A_DEEPEP_CLONE}" archive --format=tar.gz \
    -o "$PWD/.gpu/deepep-567632d.tgz" 567632d
fi
du -sh .gpu/whl .gpu/whl_serve .gpu/vllm_py-*.tgz .gpu/deepep-567632d.tgz
