# syntax=docker/dockerfile:1
# One image for every kxpu component (entry point `kxpu`). The same image, without a container engine or
# registry: hack/image/build.sh. Both install Debian bookworm's python3 and the hash-pinned wheels of
# hack/image/requirements.txt into a venv at /opt/kxpu.
#
#   docker build --build-arg VERSION=0.1.0 -t registry.example.com/kxpu:0.1.0 .
#   (buildah bud / podman build work the same; BASE may point at a mirror of debian:bookworm-slim)
#
# Pin the base by digest for a release build (docs/security.md):
#   --build-arg BASE=debian:bookworm-slim@sha256:<digest from your registry or mirror>
# The default is the tag: the project ships no digest it could not verify. hack/image/build.sh needs neither: it
# builds the base from the Debian archive (apt checks the signed Release files).
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# pip trusts the system CA bundle (so a TLS-inspecting proxy's CA can be added there) and may use a mirror;
# build arguments reach the build stage only.
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
# A throwaway venv with the pinned pip; it installs into /opt/kxpu, which gets no pip of its own.
COPY hack/image/installer.txt hack/image/requirements.txt /tmp/lock/
RUN python3 -m venv /tmp/tools \
 && /tmp/tools/bin/pip install --no-cache-dir --disable-pip-version-check --require-hashes -r /tmp/lock/installer.txt \
 && python3 -m venv --without-pip /opt/kxpu \
 && /tmp/tools/bin/pip --python /opt/kxpu/bin/python install --no-cache-dir --disable-pip-version-check \
      --only-binary=:all: --require-hashes -r /tmp/lock/requirements.txt
# Sources last: a code change rebuilds only what follows.
COPY pyproject.toml README.md /src/
COPY kxpu /src/kxpu
RUN /tmp/tools/bin/pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir /tmp/wheels /src \
 && /tmp/tools/bin/pip --python /opt/kxpu/bin/python install --no-cache-dir --disable-pip-version-check \
      --no-deps /tmp/wheels/kxpu-*.whl \
 && /tmp/tools/bin/pip --python /opt/kxpu/bin/python check

FROM ${BASE}
ARG VERSION=dev
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/* \
 && echo "kxpu:x:65532:65532:kxpu:/nonexistent:/usr/sbin/nologin" >>/etc/passwd \
 && echo "kxpu:x:65532:" >>/etc/group
COPY --from=build /opt/kxpu /opt/kxpu
ENV PATH=/opt/kxpu/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Not root by default. The node daemon's pod runs as root (the device-plugin directory and /dev need it);
# the chart says so explicitly.
USER 65532:65532
ENTRYPOINT ["/opt/kxpu/bin/kxpu"]
CMD ["--help"]
LABEL org.opencontainers.image.title="kxpu" \
      org.opencontainers.image.description="kxpu: heterogeneous accelerators on Kubernetes" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="debian:bookworm-slim"
