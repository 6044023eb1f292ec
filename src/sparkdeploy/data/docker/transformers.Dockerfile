# The seed's derivative image: a community engine image plus an exact transformers release.
#
# Build context: a directory holding probe_image.py (helpers/probe_image.py) and model/config.json
# (the model's small config files).  The build task resolves `transformers>=5` to a concrete
# version from the package index first (the newest one that also satisfies what the base image's
# engine declares), and computes the sha256 of this file:
#
#   docker build -f docker/transformers.Dockerfile \
#     --build-arg BASE_IMAGE=scitrera/dgx-spark-sglang:0.5.10rc0 \
#     --build-arg BASE_IMAGE_ID=sha256:... --build-arg BASE_IMAGE_DIGEST=sha256:... \
#     --build-arg NCCL=image|system --build-arg TRANSFORMERS_VERSION=5.3.0 \
#     --build-arg TRANSFORMERS_REQUIREMENT='transformers>=5' \
#     --build-arg ENGINE_REQUIRES='sglang 0.5.10rc0: transformers==5.3.0' \
#     --build-arg DOCKERFILE_SHA256=... [--build-arg PIP_INDEX_URL=http://index.lab/simple] \
#     [--secret id=pipconf,src=pip.conf] [--secret id=pip_ca,src=ca.pem] -t TAG CONTEXT
#
# Secrets and history.  Build args are recorded in the image history (`docker history` shows
# `|N PIP_INDEX_URL=... /bin/sh -c ...` for RUN steps, with both builders), so PIP_INDEX_URL must
# be credential-free: the build task refuses a URL with user:password@.  Credentials (a pip.conf
# with an authenticated index-url) and a CA bundle for a TLS-intercepting proxy come as BuildKit
# secrets, mounted only for the RUN that needs them: never in a layer, never in the history.
# Both mounts are optional (secret mounts default to required=false): the file builds without them.
#
# Builders.  Docker 23+ uses BuildKit when the buildx plugin is installed (the Sparks' Docker CE);
# without it (Debian's docker.io CLI, the lab) `docker build` falls back to the legacy builder,
# which rejects `RUN --mount`.  This file is written so that deleting every `--mount=...` word
# gives a valid legacy Dockerfile with the same steps: the build task does exactly that
# (re.sub(r"--mount=\S+\s*", "", text), fed with `-f -`) when the engine has no BuildKit, and then
# refuses --secret inputs (an authenticated index or a private CA need BuildKit).  The hash label
# is the hash of this file either way.
#
# No `# syntax=` line on purpose: it makes BuildKit pull a frontend image from a registry, which
# the lab (and an air-gapped site) cannot reach; the built-in frontend supports secret mounts.

ARG BASE_IMAGE=scitrera/dgx-spark-sglang:0.5.10rc0

FROM ${BASE_IMAGE} AS transformers
ARG BASE_IMAGE
ARG BASE_IMAGE_ID=""
ARG TRANSFORMERS_VERSION
ARG DOCKERFILE_SHA256=""
ARG PIP_INDEX_URL=""
ARG PIP_TRUSTED_HOST=""
# One layer: exactly the resolved transformers release, installed into the image's own python3
# environment (the one the engine runs in: a venv would not be seen by `python3 -m sglang...`).
# PIP_BREAK_SYSTEM_PACKAGES=1: the base image's python may be PEP 668 "externally managed"
# (Debian/Ubuntu system python); inside an image build that environment IS the application's
# environment, so overriding the guard is correct here, for this one command only (it is not an
# ENV, so it does not persist in the image).  Never do this on a node's system python.
# The version is resolved by the build task together with what the base image's engine declares
# of transformers (SGLang 0.5.10rc0 declares transformers==5.3.0), so pip has no conflict to report
# unless the profile overrides that declaration (images.layer.override_engine_requirement).
RUN --mount=type=secret,id=pipconf \
    --mount=type=secret,id=pip_ca \
    set -eu; \
    test -n "${TRANSFORMERS_VERSION}" || { echo "TRANSFORMERS_VERSION is required" >&2; exit 1; }; \
    if [ -f /run/secrets/pipconf ]; then export PIP_CONFIG_FILE=/run/secrets/pipconf; fi; \
    if [ -f /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    if [ -n "${PIP_INDEX_URL}" ]; then export PIP_INDEX_URL; else unset PIP_INDEX_URL; fi; \
    if [ -n "${PIP_TRUSTED_HOST}" ]; then export PIP_TRUSTED_HOST; else unset PIP_TRUSTED_HOST; fi; \
    PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
      python3 -m pip install --no-cache-dir "transformers==${TRANSFORMERS_VERSION}"; \
    python3 -c "import importlib.metadata as m, sys; v = m.version('transformers'); \
sys.exit(0 if v == sys.argv[1] else 'transformers is %s, wanted %s' % (v, sys.argv[1]))" \
      "${TRANSFORMERS_VERSION}"

# NCCL=system: torch loads the system's libnccl2 instead of the nvidia-nccl-cu* wheel's copy
# (images.layer.nccl).  torch's wheels find libnccl.so.2 through the RPATH
# $ORIGIN/../../nvidia/nccl/lib before anything else but LD_PRELOAD, so the wheel's file becomes a
# link to the system's library (kept beside it as .sparkdeploy-wheel): the fix DGX Spark owners
# made against multi-node hangs after 20-26 minutes (vllm#42354, vllm#41725) and what
# eugr/spark-vllm-docker's use-official-vllm mod does.  A link covers every process of the
# image, whatever its environment (an LD_PRELOAD in ENV would be dropped by an engine's env
# override).  libnccl2 is installed with apt-get when the base image lacks it.
ARG NCCL=image
RUN set -eu; \
    if [ "${NCCL}" = system ]; then \
      sys_nccl=$(ls /usr/lib/*/libnccl.so.2 2>/dev/null | head -n 1 || true); \
      if [ -z "${sys_nccl}" ]; then \
        DEBIAN_FRONTEND=noninteractive apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnccl2; \
        rm -rf /var/lib/apt/lists/*; \
        sys_nccl=$(ls /usr/lib/*/libnccl.so.2 | head -n 1); \
      fi; \
      for lib in $(python3 -c "import glob, os, sys; print(' '.join(sorted({p for d in sys.path \
for p in glob.glob(os.path.join(d or '.', 'nvidia', 'nccl', 'lib', 'libnccl.so.2'))})))"); do \
        if [ "$(readlink -f "${lib}")" != "$(readlink -f "${sys_nccl}")" ]; then \
          mv "${lib}" "${lib}.sparkdeploy-wheel"; \
          ln -s "${sys_nccl}" "${lib}"; \
        fi; \
      done; \
    fi

# The probe runs in a throw-away stage: the probe script and the config never land in the image;
# only its JSON verdict does (copied below, which also makes BuildKit run this stage).
FROM transformers AS probe
ARG NCCL=image
COPY probe_image.py /tmp/sparkdeploy-probe/probe_image.py
COPY model/ /tmp/sparkdeploy-probe/model/
RUN set -eu; \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python3 /tmp/sparkdeploy-probe/probe_image.py \
      --model-dir /tmp/sparkdeploy-probe/model --require-config sglang \
      > /tmp/sparkdeploy-probe/probe.json; \
    cat /tmp/sparkdeploy-probe/probe.json; \
    python3 -c "import json, sys; c = json.load(open(sys.argv[1]))['config']; \
sys.exit(0 if c and c['ok'] else 'the model config does not parse: %s' % (c or {}).get('error'))" \
      /tmp/sparkdeploy-probe/probe.json; \
    python3 -c "import json, sys; n = json.load(open(sys.argv[1])).get('nccl') or {}; \
sys.exit(0 if sys.argv[2] != 'system' or n.get('loads') == 'system' else \
'torch would load %s, not the system NCCL: %s' % (n.get('path'), n.get('why')))" \
      /tmp/sparkdeploy-probe/probe.json "${NCCL}"

FROM transformers
ARG BASE_IMAGE
ARG BASE_IMAGE_ID=""
ARG TRANSFORMERS_VERSION
ARG TRANSFORMERS_REQUIREMENT=""
ARG ENGINE_REQUIRES=""
ARG DOCKERFILE_SHA256=""
ARG BASE_IMAGE_DIGEST=""
ARG NCCL=image
COPY --from=probe /tmp/sparkdeploy-probe/probe.json /usr/share/sparkdeploy/probe.json
LABEL org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.sparkdeploy.base.id="${BASE_IMAGE_ID}" \
      org.sparkdeploy.base.digest="${BASE_IMAGE_DIGEST}" \
      org.sparkdeploy.nccl="${NCCL}" \
      org.sparkdeploy.transformers.version="${TRANSFORMERS_VERSION}" \
      org.sparkdeploy.transformers.requirement="${TRANSFORMERS_REQUIREMENT}" \
      org.sparkdeploy.engine.requires="${ENGINE_REQUIRES}" \
      org.sparkdeploy.dockerfile.sha256="${DOCKERFILE_SHA256}"
